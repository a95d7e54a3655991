"""Tools and tool_choice of both APIs, checked at the edge.

A tool's parameter schema must be valid JSON Schema all the way down (checked against its
meta-schema with `jsonschema`, draft 2020-12 unless the schema names another in `$schema`), with
an object at the top: the chat format writes a call's arguments as named parameters.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import jsonschema
from jsonschema.exceptions import SchemaError

from model.serve.http.errors import APIError, short

# Names the chat format can carry: it reads a tool name as `[^\s<]+`.
TOOL_NAME_RE = re.compile(r"^[^\s<]+$")
MAX_TOOLS = 128

ToolMode = Literal["auto", "none", "required", "named"]


def check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise APIError(400, f"'{param}' must be a JSON Schema object, got {type(schema).__name__}",
                       param=param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError(400, f"'{param}' must have \"type\": \"object\" (tool arguments are an "
                       f"object of named parameters), got {short(kind)}", param=param)
    try:
        validator = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
        validator.check_schema(schema)
    except SchemaError as e:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise APIError(400, f"'{param}{where}' is not valid JSON Schema: {e.message}",
                       param=param) from None
    except RecursionError:
        raise APIError(400, f"'{param}' is nested too deeply to check", param=param) from None


def check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise APIError(400, f"'{param}' must be a non-empty tool name without whitespace or '<', "
                       f"got {short(name)}", param=param)
    return name


def _check_description(value: Any, param: str) -> None:
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"'{param}' must be a string, got {type(value).__name__}",
                       param=param)


def validate_openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Check OpenAI `tools`; returns them as `{"type": "function", "function": {...}}` dicts."""
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    if len(tools or []) > MAX_TOOLS:
        raise APIError(400, f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are allowed",
                       param="tools")
    for i, tool in enumerate(tools or []):
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                           "{name, description, parameters}}", param=f"tools[{i}]")
        fn = tool["function"]
        name = check_name(fn.get("name"), f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tool name {short(name)} appears twice in 'tools'", param="tools")
        names.add(name)
        _check_description(fn.get("description"), f"tools[{i}].function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def anthropic_tools_to_openai(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Anthropic `tools` (name, description, input_schema) as OpenAI function tools."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or "input_schema" not in tool:
            raise APIError(400, f"'tools[{i}]' must be a custom tool with name and input_schema",
                           param=f"tools[{i}]")
        check_name(tool.get("name"), f"tools[{i}].name")
        _check_description(tool.get("description"), f"tools[{i}].description")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    try:
        return validate_openai_tools(out)
    except APIError as e:
        e.message = e.message.replace(".function.parameters", ".input_schema")
        e.param = (e.param or "").replace(".function.parameters", ".input_schema") or None
        raise


def resolve_tool_choice(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]
) -> tuple[ToolMode, str | None]:
    """OpenAI `tool_choice` as (mode, tool name for "named")."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise APIError(400, "'tool_choice' must be auto, none, required or "
                           '{"type": "function", "function": {"name": ...}}, got '
                           f"{short(choice)}", param="tool_choice")
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
        raise APIError(400, f"'tool_choice' names {short(name)}, which is not in 'tools' "
                       f"({short(known, 200)})", param="tool_choice")
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
        raise APIError(400, "'tool_choice.type' must be auto, any, tool or none, got "
                       f"{short(kind)}", param="tool_choice")
    return resolve_tool_choice(mapped[kind], tools)
