"""Beam's chat template: render a conversation to the prompt of `docs/format.md`.

The demo template `CHAT_TEMPLATE` is the format's reference rendering; a real checkpoint ships its
own in `tokenizer_config.json` (or `chat_template.jinja`), which `read_chat_template` prefers.
`ChatTemplate` renders either in a Jinja sandbox set up as transformers sets it up, so a prompt
renders identically here and in `AutoTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_EFFORTS: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
DEFAULT_REASONING_EFFORT = "max"
# Reasoning-token budget per effort; the server closes reasoning when the budget is spent.
REASONING_BUDGET: dict[str, int] = {
    "none": 0,
    "minimal": 32,
    "low": 64,
    "medium": 128,
    "high": 256,
    "xhigh": 384,
    "max": 512,
}

# Choices the format leaves open (documented here, asserted in tests/test_tokenizer.py):
# - A header system message always comes first: "Reasoning: EFFORT", then "# Tools" with one JSON
#   object per tool when tools are given. The caller's own system/developer messages follow it.
# - Tool results render as `<|start|>tool from=NAME<|message|>RESULT<|end|>`; NAME is the message's
#   `name`, else the name of the call whose id is its `tool_call_id`, else the call at its position.
# - An assistant turn always renders its reasoning (empty when absent), so history matches what the
#   model generated; content and tool calls in one turn render as a final message, then the calls.
# - Effort "none" pre-fills an empty analysis message in the generation prompt, so the model starts
#   directly at its answer or tool call and the parser still sees reasoning (empty) first.
CHAT_TEMPLATE: str = r"""
{%- set efforts = ['none', 'minimal', 'low', 'medium', 'high', 'xhigh', 'max'] -%}
{%- if reasoning_effort is defined and reasoning_effort is not none -%}
  {%- set effort = reasoning_effort -%}
{%- else -%}
  {%- set effort = 'max' -%}
{%- endif -%}
{%- if effort not in efforts -%}
  {{- raise_exception('reasoning_effort must be one of ' ~ efforts | join(', ')
                      ~ ', got ' ~ effort) -}}
{%- endif -%}
{%- macro text_of(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}{{- content -}}
  {%- elif content is mapping -%}{{- content | tojson -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part.type == 'text' -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>Reasoning: ' ~ effort -}}
{%- if tools -%}
  {{- '\n\n# Tools' -}}
  {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
{%- endif -%}
{{- '<|end|>' -}}
{%- set ns = namespace(names=[], ids=[], position=0) -%}
{%- for message in messages -%}
  {%- if message.role in ['system', 'developer', 'user'] -%}
    {{- '<|start|>' ~ message.role ~ '<|message|>' ~ text_of(message.content) ~ '<|end|>' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is defined -%}
    {{- '<|start|>assistant<|channel|>analysis<|message|>' ~ text_of(reasoning) ~ '<|end|>' -}}
    {%- set calls = message.tool_calls if message.tool_calls is defined else none -%}
    {%- set calls = calls if calls else [] -%}
    {%- set answer = text_of(message.content) if message.content is defined else '' -%}
    {%- if answer or not calls -%}
      {{- '<|start|>assistant<|channel|>final<|message|>' ~ answer ~ '<|end|>' -}}
    {%- endif -%}
    {%- set ns.names = [] -%}
    {%- set ns.ids = [] -%}
    {%- set ns.position = 0 -%}
    {%- for call in calls -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set args = fn.arguments if fn.arguments is defined else none -%}
      {%- set args = args if args is not none else {} -%}
      {%- if args is string -%}
        {{- raise_exception('tool call arguments must be a JSON object, got a string for '
                            ~ fn.name ~ '; parse it before rendering') -}}
      {%- endif -%}
      {%- set ns.names = ns.names + [fn.name] -%}
      {%- set ns.ids = ns.ids + [call.id if call.id is defined else none] -%}
      {{- '<|start|>assistant to=' ~ fn.name ~ '<|channel|>analysis <|constrain|>xml<|message|>' -}}
      {%- for key, value in args | dictsort(true) -%}
        {{- '<rfl:parameter name="' ~ key ~ '">\n' -}}
        {{- (value if value is string else value | tojson) ~ '\n</rfl:parameter>' -}}
      {%- endfor -%}
      {{- '<|call|>' -}}
    {%- endfor -%}
  {%- elif message.role == 'tool' -%}
    {%- set ns2 = namespace(name=none) -%}
    {%- if message.name is defined and message.name -%}
      {%- set ns2.name = message.name -%}
    {%- elif message.tool_call_id is defined and message.tool_call_id in ns.ids -%}
      {%- for id in ns.ids -%}
        {%- if id == message.tool_call_id -%}
          {%- set ns2.name = ns.names[loop.index0] -%}
        {%- endif -%}
      {%- endfor -%}
    {%- elif ns.position < ns.names | length -%}
      {%- set ns2.name = ns.names[ns.position] -%}
    {%- endif -%}
    {%- if ns2.name is none -%}
      {{- raise_exception('tool message ' ~ loop.index0 ~ ' names no tool: give it a name'
                          ~ ' or the tool_call_id of an earlier call') -}}
    {%- endif -%}
    {%- set ns.position = ns.position + 1 -%}
    {{- '<|start|>tool from=' ~ ns2.name ~ '<|message|>' ~ text_of(message.content) ~ '<|end|>' -}}
  {%- else -%}
    {{- raise_exception('unknown role ' ~ message.role
                        ~ '; expected system, developer, user, assistant or tool') -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {%- if effort == 'none' -%}
    {{- '<|start|>assistant<|channel|>analysis<|message|><|end|>' -}}
  {%- endif -%}
  {{- '<|start|>assistant' -}}
{%- endif -%}
"""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers' override, so both render identical strings (jinja's escapes HTML).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _compile_template(source: str) -> Any:
    # Environment settings mirror transformers' so a checkpoint's template renders the same here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    """Alias reasoning fields as transformers does, and parse JSON-string tool arguments."""
    out = dict(message)
    for key in ("reasoning_content", "thinking", "reasoning"):
        if out.get(key) is not None:
            out["reasoning_content"] = out[key]
            break
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalize_call(call) for call in calls]
    return out


def _normalize_call(call: dict[str, Any]) -> dict[str, Any]:
    # OpenAI clients send arguments as a JSON string; the template needs the object.
    call = dict(call)
    fn = dict(call["function"]) if "function" in call else call
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(
                f"tool call {fn.get('name')!r} has arguments that are not JSON ({e}); "
                "send a JSON object string or a dict"
            ) from e
    if "function" in call:
        call["function"] = fn
    return call


def read_chat_template(path: Path, config: dict[str, Any]) -> str:
    """The template a checkpoint ships, else the demo `CHAT_TEMPLATE`.

    `config` is its parsed `tokenizer_config.json`; `path` is its directory, searched for
    `chat_template.jinja` when the config has none.
    """
    template = config.get("chat_template")
    if isinstance(template, list):  # HF's named-template form: [{"name", "template"}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return template if template is not None else CHAT_TEMPLATE


class ChatTemplate:
    """A compiled chat template: `render` turns messages (and tools) into the prompt string."""

    def __init__(self, source: str = CHAT_TEMPLATE) -> None:
        self.source = source
        self._template = _compile_template(source)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        reasoning_effort: str | None = DEFAULT_REASONING_EFFORT,
    ) -> str:
        """Render `messages` to the prompt string (not tokenized)."""
        return self._template.render(
            messages=[_normalize_message(m) for m in messages],
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            reasoning_effort=reasoning_effort,
        )
