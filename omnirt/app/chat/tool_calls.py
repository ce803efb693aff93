"""Function tools and structured output in chat completions: the checks that give a bad `tools`,
`tool_choice`, `response_format` or `tool_calls` history a clear 400 before the engine sees it (a schema
that is not JSON Schema, a tool_choice naming no tool, arguments that are not JSON text), their engine
terms, and a reply's calls in OpenAI's shapes (`message.tool_calls`, streamed `delta.tool_calls`)."""

from __future__ import annotations

from typing import Any

from omnirt.app.chat.protocol import ResponseFormat, Tool
from omnirt.app.errors import APIError
from omnirt.app.fields import FieldError
from omnirt.app.tool_checks import check_functions, check_schema, engine_tool_choice


def check_tools(tools: list[Tool], tool_choice: Any) -> str | dict:
    """The engine's tool_choice ("auto" when unset); APIError 400 for a bad tool or tool_choice."""
    names = [t.function.name for t in tools]
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) and tool_choice.get(
        "type") == "function" and isinstance(tool_choice.get("function"), dict) else None
    try:
        check_functions([(t.function.name, t.function.parameters) for t in tools], "tools.{}.function")
        return engine_tool_choice(tool_choice, named if isinstance(named, str) else None, names, "tool_choice",
                                  '{"type": "function", "function": {"name": ...}}')
    except FieldError as exc:
        raise APIError(400, exc.message, exc.param, exc.code) from exc


def engine_response_format(fmt: ResponseFormat | None) -> dict | None:
    """{"type": "json_object"} or {"type": "json_schema", "schema": ...} for the engine; None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "response_format json_schema needs its `json_schema` ({name, schema})",
                       "response_format.json_schema", "invalid_value")
    try:
        check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    except FieldError as exc:
        raise APIError(400, exc.message, exc.param, exc.code) from exc
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
