"""Typed content blocks of both APIs, and the chat messages the template renders from them.

Each block is validated by the model its `type` names (a registry, not a ladder), so a block of
the wrong shape (`text` that is a number, a `tool_use` whose `id` is an object, numeric
`tool_result` content) is a 400 naming the field, never an error further in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.serve.http.errors import APIError, short
from model.serve.http.protocol import ChatMessage, MessagesRequest, validation_error


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # cache_control, citations, ...


class TextBlock(_Block):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(_Block):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


# The blocks each role may carry in Anthropic messages; OpenAI content parts are text only.
ANTHROPIC_BLOCKS: dict[str, dict[str, type[_Block]]] = {
    "user": {"text": TextBlock, "tool_result": ToolResultBlock},
    "assistant": {"text": TextBlock, "thinking": ThinkingBlock,
                  "redacted_thinking": RedactedThinkingBlock, "tool_use": ToolUseBlock},
    "system": {"text": TextBlock},
}
OPENAI_PARTS: dict[str, type[_Block]] = {"text": TextBlock}


def parse_block(block: Any, kinds: dict[str, type[_Block]], where: str, owner: str) -> _Block:
    if not isinstance(block, dict):
        raise APIError(400, f"'{where}' must be a content block object, got "
                       f"{type(block).__name__}", param=where)
    kind = block.get("type")
    model = kinds.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(400, f"'{where}' is a {short(kind)} block, which {owner} cannot carry "
                       f"here; use {', '.join(kinds)}", param=where)
    try:
        return model.model_validate(block)
    except ValidationError as e:
        raise validation_error(e, where) from None


def text_of(content: str | list[Any], where: str, owner: str) -> str:
    """Text of a string or a list of text blocks (system prompts, OpenAI content parts)."""
    if isinstance(content, str):
        return content
    return "".join(parse_block(b, {"text": TextBlock}, f"{where}[{i}]", owner).text  # type: ignore[attr-defined]
                   for i, b in enumerate(content))


def openai_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the template's dicts, with their content parts checked."""
    out = []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            msg["content"] = text_of(m.content, f"messages[{i}].content", "an OpenAI message "
                                     "(this model takes text parts only)")
        out.append(msg)
    return out


def anthropic_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic system + messages as chat-template messages (OpenAI roles)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _system_text(req.system)})
    names: dict[str, str] = {}
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        blocks = [parse_block(b, ANTHROPIC_BLOCKS[msg.role], f"messages[{i}].content[{j}]",
                              f"a {msg.role} message") for j, b in enumerate(msg.content)]
        out += _turns(msg.role, blocks, names)
    return [{k: v for k, v in m.items() if v is not None} for m in out]


def _system_text(system: str | list[Any]) -> str:
    if isinstance(system, str):
        return system
    blocks = [parse_block(b, ANTHROPIC_BLOCKS["system"], f"system[{i}]", "a system prompt")
              for i, b in enumerate(system)]
    return "\n".join(b.text for b in blocks)  # type: ignore[attr-defined]


def _turns(role: str, blocks: list[_Block], names: dict[str, str]) -> list[dict[str, Any]]:
    """One message's blocks as template turns: tool results become `tool` turns of their own."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] = {"role": role, "content": ""}
    for block in blocks:
        if isinstance(block, TextBlock):
            turn["content"] += block.text
        elif isinstance(block, ThinkingBlock):
            turn["reasoning_content"] = block.thinking
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            turn.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function",
                 "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            if turn["content"]:
                out.append(turn)
                turn = {"role": role, "content": ""}
            result = f"Error: {block.text}" if block.is_error else block.text
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "name": names.get(block.tool_use_id), "content": result})
        # redacted thinking: nothing the model can read back
    if turn["content"] or turn.get("tool_calls") or role == "assistant":
        out.append(turn)
    return out
