"""Realtime's function tools: a session's or response's `tools` (the flat shape, `{"type": "function", name,
description, parameters}`) and `tool_choice` (`{"type": "function", name}` for one function), checked as
chat completions checks them (`omnirt/app/tool_checks.py`) and turned into the engine's (chat) shapes."""

from __future__ import annotations

from typing import Any

from omnirt.app.fields import FieldError, rule
from omnirt.app.realtime.events import ProtocolError, check_fields, require
from omnirt.app.tool_checks import check_functions, engine_tool_choice

TOOL_FIELDS = rule(("type", "name", "description", "parameters"))


def parse_tools(obj: dict, where: str, current: tuple[dict, ...]) -> tuple[dict, ...]:
    """A session's or response's `tools` (each {type: "function", name, description, parameters}); `current`
    when absent."""
    tools = require(obj, "tools", (list,), where)
    if tools is None:
        return current
    for i, tool in enumerate(tools):
        at = f"{where}.tools.{i}"
        if not isinstance(tool, dict):
            raise ProtocolError(f"`{at}` must be an object", "invalid_type", at)
        check_fields(TOOL_FIELDS, tool, at)
        if tool.get("type") != "function":
            raise ProtocolError(f"`{at}.type` must be 'function'", "invalid_value", f"{at}.type")
        require(tool, "description", (str,), at)
    return tuple(tools)


def engine_tools(tools: tuple[dict, ...], choice: Any, where: str) -> tuple[tuple[dict, ...], str | dict]:
    """Realtime's flat function tools and tool_choice in the engine's (chat) shapes; ProtocolError if bad.
    `"required"` without tools forces nothing (as OpenAI's Realtime API, which keeps it for the tools a later
    update brings; chat completions refuses it)."""
    if choice == "required" and not tools:
        return (), "auto"
    named = choice.get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    try:
        check_functions([(t.get("name"), t.get("parameters")) for t in tools], f"{where}.tools.{{}}")
        choice = engine_tool_choice(choice, named if isinstance(named, str) else None, [t["name"] for t in tools],
                                    f"{where}.tool_choice", '{"type": "function", "name": ...}')
    except FieldError as exc:
        raise ProtocolError(exc.message, exc.code, exc.param) from exc
    functions = tuple({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                        if t.get(k) is not None}} for t in tools)
    return functions, choice
