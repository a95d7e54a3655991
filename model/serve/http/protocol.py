"""Request models and error shapes of the OpenAI and Anthropic HTTP APIs.

Requests are validated from the raw body with pydantic in strict JSON mode, so a wrong type
(`"temperature": "hot"`, `"max_tokens": 1.5`) is a 400 naming the field instead of a silent
coercion. Fields a client may send that the server does not use are ignored, as OpenAI SDKs send
many (`user`, `metadata`, `service_tier`, ...).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Names the chat format can carry: FORMAT.md reads a tool name as `[^\s<]+`.
TOOL_NAME_RE = re.compile(r"^[^\s<]+$")

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}


class APIError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), rendered in the API's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        kind = _OPENAI_ERROR_TYPES.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON request body; any problem is a 400 APIError naming the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(
                400, f"the request body is not valid JSON ({first['msg']}); send a JSON object",
                code="invalid_json",
            ) from None
        param = _loc_to_param(tuple(first["loc"])) or None
        where = f"'{param}': " if param else ""
        got = first.get("input")
        shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
        raise APIError(400, f"{where}{first['msg']}{shown}", param=param) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Sampling(_Request):
    """Sampling fields shared by every endpoint; ranges are checked by pydantic."""

    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False


class StreamOptions(_Request):
    include_usage: bool = False


class ChatMessage(BaseModel):
    # Extra keys (e.g. `thinking`, `reasoning`) reach the chat template as they came.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions endpoint
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # vLLM's extension; True is vLLM's default, so stop and format tokens stay out of `text`.
    skip_special_tokens: bool = True


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Sampling):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Not in Anthropic's API: lets a client pick Beam's effort level directly.
    reasoning_effort: str | None = None


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(400, "'stop' holds an empty string; remove it", param="stop")
    if len(stops) > 16:
        raise APIError(400, f"'stop' has {len(stops)} strings; at most 16 are allowed",
                       param="stop")
    return stops


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise APIError(400, f"'{param}' must be a JSON Schema object, got {type(schema).__name__}",
                       param=param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError(400, f"'{param}' must have \"type\": \"object\" (tool arguments are an "
                       f"object of named parameters), got {kind!r}", param=param)
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise APIError(400, f"'{param}.properties' must map each parameter name to a schema "
                       "object", param=param)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError(400, f"'{param}.required' must be a list of parameter names", param=param)


def _check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise APIError(400, f"'{param}' must be a non-empty tool name without whitespace or '<', "
                       f"got {name!r}", param=param)
    return name


def validate_openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Check OpenAI `tools`; returns them as `{"type": "function", "function": {...}}` dicts."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                           "{name, description, parameters}}", param=f"tools[{i}]")
        fn = tool["function"]
        name = _check_name(fn.get("name"), f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tool name {name!r} appears twice in 'tools'", param="tools")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_schema(params, f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def anthropic_tools_to_openai(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Anthropic `tools` (name, description, input_schema) as OpenAI function tools."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or "input_schema" not in tool:
            raise APIError(400, f"'tools[{i}]' must be a custom tool with name and input_schema",
                           param=f"tools[{i}]")
        _check_name(tool.get("name"), f"tools[{i}].name")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    try:
        return validate_openai_tools(out)
    except APIError as e:
        e.message = e.message.replace(".function.parameters", ".input_schema")
        raise


ToolMode = Literal["auto", "none", "required", "named"]


def resolve_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]
) -> tuple[ToolMode, str | None]:
    """OpenAI `tool_choice` as (mode, tool name for "named")."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError(400, f"'tool_choice' must be auto, none, required or "
                           f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
                           param="tool_choice")
        mode: ToolMode = choice  # type: ignore[assignment]
        name = None
    else:
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "'tool_choice' object must be "
                           '{"type": "function", "function": {"name": NAME}}', param="tool_choice")
        mode = "named"
    if mode in ("required", "named") and not tools:
        raise APIError(400, f"'tool_choice' is {mode} but no 'tools' were given",
                       param="tool_choice")
    known = [t["function"]["name"] for t in tools]
    if name is not None and name not in known:
        raise APIError(400, f"'tool_choice' names {name!r}, which is not in 'tools' ({known})",
                       param="tool_choice")
    return mode, name


def resolve_anthropic_tool_choice(
    choice: dict[str, Any] | None, tools: list[dict[str, Any]]
) -> tuple[ToolMode, str | None]:
    """Anthropic `tool_choice` ({type: auto|any|tool|none, name}) as (mode, name)."""
    if choice is None:
        return resolve_tool_choice(None, tools)
    kind = choice.get("type")
    mapped: dict[str, str | dict[str, Any]] = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        return resolve_tool_choice(
            {"type": "function", "function": {"name": choice.get("name")}}, tools
        )
    if kind not in mapped:
        raise APIError(400, f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}",
                       param="tool_choice")
    return resolve_tool_choice(mapped[kind], tools)
