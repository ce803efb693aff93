"""Function tools and structured output in chat completions: the checks that give a bad `tools`,
`tool_choice`, `response_format` or `tool_calls` history a clear 400 before the engine sees it (a schema
that is not JSON Schema, a tool_choice naming no tool, arguments that are not JSON text), their engine
terms, and a reply's calls in OpenAI's shapes (`message.tool_calls`, streamed `delta.tool_calls`)."""

from __future__ import annotations

import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from app.chat.protocol import FUNCTION_NAME, ResponseFormat, Tool
from app.errors import APIError

NAME = re.compile(FUNCTION_NAME)


def check_tools(tools: list[Tool], tool_choice: Any) -> str | dict:
    """The engine's tool_choice: "auto" when unset; APIError 400 for a bad schema, a repeated name, or a
    tool_choice that is not "none", "auto", "required" or {"type": "function", "function": {"name"}} of a
    listed tool."""
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        where = f"tools.{i}.function"
        if not NAME.match(tool.function.name):
            raise APIError(400, f"{where}.name must be 1-64 letters, digits, '_' or '-'", f"{where}.name",
                           "invalid_value")
        if names.index(tool.function.name) != i:
            raise APIError(400, f"two tools are named {tool.function.name!r}", f"{where}.name", "invalid_value")
        check_schema(tool.function.parameters, f"{where}.parameters")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return tool_choice or "auto"
    if tool_choice == "required":
        if not tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice", "invalid_value")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                       '"function": {"name": ...}}', "tool_choice", "invalid_value")
    if name not in names:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools", "tool_choice",
                       "invalid_value")
    return {"type": "function", "function": {"name": name}}


def check_schema(schema: dict | None, where: str) -> None:
    if schema is None:
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise APIError(400, f"{where} is not a valid JSON Schema: {exc.message}", where, "invalid_schema") from exc


def engine_response_format(fmt: ResponseFormat | None) -> dict | None:
    """{"type": "json_object"} or {"type": "json_schema", "schema": ...} for the engine; None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "response_format json_schema needs its `json_schema` ({name, schema})",
                       "response_format.json_schema", "invalid_value")
    check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    return {"type": "json_schema", "schema": fmt.json_schema.schema_}


def message_tool_calls(calls: list[dict]) -> list[dict]:
    """A reply's calls as `message.tool_calls`."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def delta_tool_call(index: int, call_id: str | None, name: str | None, arguments: str) -> dict:
    """A streamed `delta.tool_calls` entry: the first of a call has its id, type and name."""
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
