"""Request models of the OpenAI and Anthropic HTTP APIs, validated at the edge.

Bodies are validated with pydantic in strict JSON mode, so a wrong type (`"temperature": "hot"`,
`"max_tokens": 1.5`, a block whose `text` is a number) is a 400 naming the field instead of a
silent coercion or a failure deeper in. Every number is range-checked here: seeds fit in int64,
probabilities in their interval, temperatures in [0, 100]. Fields a client may send that the
server does not use are ignored, as OpenAI SDKs send many (`user`, `metadata`, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from model.serve.http.errors import APIError, short

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024  # each; a stop string is matched against every decoded chunk
MAX_LOGPROBS = 20


# pydantic names the member of a union it tried in the error's location; not a field.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def loc_to_param(loc: tuple[Any, ...], prefix: str = "") -> str:
    """pydantic's error location as the API's parameter path: `messages[0].content[1].text`."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or "-" in part or part in _UNION_MEMBERS):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error(e: ValidationError, prefix: str = "") -> APIError:
    errors = e.errors()
    if errors[0]["type"] == "json_invalid":
        first = errors[0]
        return APIError(400, f"the request body is not valid JSON ({first['msg']}); send a JSON "
                        "object", code="invalid_json")
    # A union reports one error per member; the one that went deepest says the most.
    first = max(errors, key=lambda err: len(loc_to_param(tuple(err["loc"]))))
    param = loc_to_param(tuple(first["loc"]), prefix) or None
    where = f"'{param}': " if param else ""
    got = first.get("input")
    shown = "" if isinstance(got, dict | list) else f" (got {short(got)})"
    return APIError(400, f"{where}{first['msg']}{shown}", param=param)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON request body; any problem is a 400 APIError naming the field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Sampling(_Request):
    """Sampling fields shared by every endpoint. A temperature below a small floor is greedy
    (engine/sampler.py, as vLLM does); top_k is also checked against the vocabulary."""

    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False


class StreamOptions(_Request):
    include_usage: bool = False


# ---- OpenAI chat ------------------------------------------------------------------------------
class FunctionCall(_Request):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _object_arguments(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        if not value.strip():
            return {}
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not JSON ({e}); send a JSON object "
                             "string") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"tool call arguments must be a JSON object, got a JSON "
                             f"{type(parsed).__name__}")
        return parsed


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Other keys reach the chat template as they came (a checkpoint's template may read them).
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # parts: content.py checks each
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None  # tools.py checks each
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy completions endpoint
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # vLLM's extension; True is vLLM's default, so stop and format tokens stay out of `text`.
    skip_special_tokens: bool = True


# ---- Anthropic messages -----------------------------------------------------------------------
class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # blocks: content.py checks each


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


def normalize_stop(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """Stop strings of either API, with the same limits on their count and length."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"'{param}' has {len(stops)} strings; at most {MAX_STOP_SEQUENCES} "
                       "are allowed", param=param)
    for i, s in enumerate(stops):
        if not s:
            raise APIError(400, f"'{param}[{i}]' is an empty string; remove it", param=param)
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"'{param}[{i}]' is {len(s)} characters; a stop string may have "
                           f"at most {MAX_STOP_CHARS}", param=param)
    return stops
