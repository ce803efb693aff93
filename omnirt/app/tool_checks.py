"""Function tools, whichever protocol carries them (chat completions, Realtime): the checks that give a
bad tool list or tool_choice a clear error before the engine sees it (a name OpenAI would refuse, the
same name twice, parameters that are not JSON Schema, a tool_choice naming no listed tool). Errors are
`FieldError`s, which each protocol turns into its own shape."""

from __future__ import annotations

import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from omnirt.app.fields import FieldError

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
_NAME = re.compile(FUNCTION_NAME)


def check_functions(functions: list[tuple[str, dict | None]], where: str) -> None:
    """(name, parameters) of each tool; `where` names the Nth tool's object once formatted with N."""
    names = [name for name, _ in functions]
    for i, (name, parameters) in enumerate(functions):
        at = where.format(i)
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError(f"{at}.name must be 1-64 letters, digits, '_' or '-'", f"{at}.name", "invalid_value")
        if names.index(name) != i:
            raise FieldError(f"two tools are named {name!r}", f"{at}.name", "invalid_value")
        check_schema(parameters, f"{at}.parameters")


def check_schema(schema: Any, where: str) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise FieldError(f"{where} must be a JSON Schema object", where, "invalid_schema")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise FieldError(f"{where} is not a valid JSON Schema: {exc.message}", where, "invalid_schema") from exc


def engine_tool_choice(choice: Any, named: str | None, names: list[str], where: str, shape: str) -> str | dict:
    """The engine's tool_choice ("auto" when unset) from the protocol's: "none", "auto", "required", or a
    named function (`named`: the name the protocol's object gives, None if the object is not one; `shape`
    is that object as the protocol writes it, for the error)."""
    if choice is None or choice in ("none", "auto"):
        return choice or "auto"
    if choice == "required":
        if not names:
            raise FieldError(f"{where} 'required' needs tools", where, "invalid_value")
        return choice
    if named is None:
        raise FieldError(f'{where} must be "none", "auto", "required" or {shape}', where, "invalid_value")
    if named not in names:
        raise FieldError(f"{where} names the function {named!r}, which is not in tools", where, "invalid_value")
    return {"type": "function", "function": {"name": named}}
