"""Split Beam's generated text into reasoning, answer and tool calls (format: docs/format.md).

The input is what the model generates after the prompt's `<|start|>assistant`, decoded with its
special tokens, e.g.

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant to=NAME<|channel|>analysis
    <|constrain|>xml<|message|><rfl:parameter name="k">\\nVALUE\\n</rfl:parameter><|call|>

One state machine serves both APIs: `parse_response` feeds it the whole text at once, streaming
feeds it deltas. Every decision it takes depends only on text it has already seen, and it holds
back any suffix that could still grow into a marker, so any split of the text gives the same
result. Choices the format leaves open:
- Every message ends at `<|return|>`, `<|end|>` or `<|call|>`; text after that and before the next
  `<|start|>assistant` is outside any message and dropped.
- A message header is ` to=NAME` (a tool call) and/or `<|channel|>CHANNEL` up to `<|message|>`;
  channel `analysis` is reasoning, any other channel is answer. Text that cannot begin a header is
  read as answer text, so output that ignores the format still reaches the user.
- Several analysis or final messages concatenate without a separator.
- Tool arguments go out whole in one `tool_call_args` delta when the call closes, so no partial
  `<rfl:parameter` element is ever emitted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from model.serve.tokenizer import SPECIAL_TOKENS

CLOSERS: tuple[str, ...] = ("<|return|>", "<|end|>", "<|call|>")
NEXT_MESSAGE = "<|start|>assistant"
MESSAGE = "<|message|>"
# A header must begin with one of these; anything else is read as answer text.
_HEADER_OPENERS: tuple[str, ...] = (" to=", "to=", "<|channel|>", MESSAGE, NEXT_MESSAGE)
_NAME_RE = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL_RE = re.compile(r"<\|channel\|>([^\s<]*)")
_PARAM_RE = re.compile(r'<rfl:parameter name="([^"]*)">(.*?)</rfl:parameter>', re.DOTALL)
_PARAM_OPEN_RE = re.compile(r'<rfl:parameter name="([^"]*)">')
_PARAM_CLOSE = "</rfl:parameter>"
_JSON_TYPES = frozenset({"integer", "number", "boolean", "object", "array", "null"})

DeltaKind = Literal["reasoning", "content", "tool_call_start", "tool_call_args"]
_State = Literal["header", "between", "reasoning", "content", "tool"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedResponse:
    reasoning: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """One streaming event: text for reasoning/content; name or arguments JSON for tool calls."""

    kind: DeltaKind
    text: str = ""
    name: str = ""
    index: int = -1
    arguments: str = ""


def parse_response(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedResponse:
    """Parse a whole (possibly truncated) generated text."""
    parser = StreamingParser(tools)
    parser.feed(text)
    parser.finish()
    return parser.result()


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One tool-call message as the chat template writes it (arguments sorted by name)."""
    params = "".join(
        f'<rfl:parameter name="{key}">\n{_value_text(arguments[key])}\n{_PARAM_CLOSE}'
        for key in sorted(arguments)
    )
    header = f"<|start|>assistant to={name}<|channel|>analysis <|constrain|>xml<|message|>"
    return f"{header}{params}<|call|>"


def _value_text(value: Any) -> str:
    # Matches the template's `value if value is string else value | tojson`.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = max(len(m) for m in markers) - 1
    for start in range(max(0, len(text) - longest), len(text)):
        tail = text[start:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return len(text) - start
    return 0


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Position and text of the earliest marker in `text`, or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        pos = text.find(marker)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, marker
    return best, found


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):  # a boolean schema (`true` / `false`) names no type
        return set()
    declared = schema.get("type")
    listed = declared if isinstance(declared, list) else [declared]
    types = {t for t in listed if isinstance(t, str)}
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            types |= _schema_types(sub)
    return types


def _tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> its parameters' `properties`; accepts OpenAI and flat tool dicts."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _coerce(value: str, schema: dict[str, Any] | None) -> Any:
    """Parse `value` as JSON when the schema gives it only non-string JSON types."""
    types = _schema_types(schema) if schema else set()
    if not types or "string" in types or not types <= _JSON_TYPES:
        return value
    try:
        return json.loads(value, parse_constant=_no_constant)
    except ValueError:
        return value  # the model wrote text where the schema wants JSON: keep what it wrote


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would make the response invalid


def _strip_value(value: str) -> str:
    # The format wraps each value in exactly one newline on each side.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parse_arguments(body: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    """Arguments from a tool call's body; an unclosed last parameter (truncation) is kept."""
    properties = properties or {}
    args: dict[str, Any] = {}
    end = 0
    for match in _PARAM_RE.finditer(body):
        args[match.group(1)] = _strip_value(match.group(2))
        end = match.end()
    opened = _PARAM_OPEN_RE.search(body, end)
    if opened is not None:
        value = body[opened.end() :]
        value = value[: len(value) - _partial_suffix(value, (_PARAM_CLOSE,))]
        args[opened.group(1)] = _strip_value(value)
    return {k: _coerce(v, properties.get(k)) for k, v in args.items()}


class StreamingParser:
    """Incremental parser: `feed` text deltas, then `finish`; `result` is the whole parse."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._properties = _tool_properties(tools)
        self._buf = ""
        self._state: _State = "header"
        self._tool_name: str | None = None  # name of the open tool call, once its name is whole
        self._tool_body = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._out: list[Delta] = []
        self._finished = False

    def feed(self, text_delta: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish(): make a new StreamingParser per response")
        self._buf += text_delta
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        """Flush held-back text at the end of generation (truncated text yields what is there)."""
        if self._finished:
            return []
        deltas = self._drain(final=True)
        self._finished = True
        return deltas

    def result(self) -> ParsedResponse:
        return ParsedResponse(
            reasoning="".join(self._reasoning),
            content="".join(self._content),
            tool_calls=[ToolCall(c.name, dict(c.arguments)) for c in self._calls],
        )

    def _drain(self, final: bool) -> list[Delta]:
        handlers = {
            "header": self._header,
            "between": self._between,
            "reasoning": self._text_body,
            "content": self._text_body,
            "tool": self._tool_call_body,
        }
        while handlers[self._state](final):
            pass
        out, self._out = self._out, []
        return out

    def _start_tool(self, name: str) -> None:
        self._tool_name, self._tool_body = name, ""
        self._out.append(Delta("tool_call_start", name=name, index=len(self._calls)))

    def _close_tool(self) -> None:
        assert self._tool_name is not None
        args = parse_arguments(self._tool_body, self._properties.get(self._tool_name))
        index = len(self._calls)
        self._calls.append(ToolCall(self._tool_name, args))
        arguments = json.dumps(args, ensure_ascii=False)
        self._out.append(Delta("tool_call_args", index=index, arguments=arguments))
        self._tool_name, self._tool_body = None, ""

    def _header(self, final: bool) -> bool:
        """Read ` to=NAME<|channel|>CH ... <|message|>`; returns whether it made progress."""
        buf = self._buf
        if buf.startswith(NEXT_MESSAGE):
            self._buf = buf[len(NEXT_MESSAGE) :]
            return True
        if buf and not any(o.startswith(buf) or buf.startswith(o) for o in _HEADER_OPENERS):
            self._state = "content"  # not a header: the model wrote plain text
            return True
        end, marker = _first_of(buf, (MESSAGE, *CLOSERS))
        header = buf if end < 0 else buf[:end]
        if self._tool_name is None:
            name = _NAME_RE.search(header)
            # A name is whole once something follows it, the header ends, or the text ends.
            if name is not None and (name.end() < len(header) or end >= 0 or final):
                self._start_tool(name.group(1))
        if end < 0:
            if final:
                self._buf = ""
                if self._tool_name is not None:
                    self._close_tool()
            return False
        self._buf = buf[end + len(marker) :]
        if marker != MESSAGE:  # a closer before any body: the message is empty
            if self._tool_name is not None:
                self._close_tool()
            self._state = "between"
        elif self._tool_name is not None:
            self._state = "tool"
        else:
            channel = _CHANNEL_RE.search(header)
            analysis = channel is not None and channel.group(1) == "analysis"
            self._state = "reasoning" if analysis else "content"
        return True

    def _between(self, final: bool) -> bool:
        pos = self._buf.find(NEXT_MESSAGE)
        if pos >= 0:
            self._buf = self._buf[pos + len(NEXT_MESSAGE) :]
            self._state = "header"
            return True
        keep = 0 if final else _partial_suffix(self._buf, (NEXT_MESSAGE,))
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _take_body(self, final: bool) -> tuple[str, bool]:
        """Body text safe to hand on, and whether a closer ended the message."""
        pos, closer = _first_of(self._buf, CLOSERS)
        if pos >= 0:
            text, self._buf = self._buf[:pos], self._buf[pos + len(closer) :]
            return text, True
        # Hold back what could still become a special token, so no marker leaks out in pieces.
        keep = 0 if final else _partial_suffix(self._buf, SPECIAL_TOKENS)
        cut = len(self._buf) - keep
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text, False

    def _text_body(self, final: bool) -> bool:
        text, closed = self._take_body(final)
        if text:
            kind: DeltaKind = "reasoning" if self._state == "reasoning" else "content"
            (self._reasoning if kind == "reasoning" else self._content).append(text)
            self._out.append(Delta(kind, text=text))
        if closed:
            self._state = "between"
        return closed

    def _tool_call_body(self, final: bool) -> bool:
        text, closed = self._take_body(final)
        self._tool_body += text
        if closed or final:
            self._close_tool()
            self._state = "between"
        return closed
