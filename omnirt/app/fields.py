"""The one rule for request fields, the same for chat completions and for the Realtime session and
response objects (docs/api-fields.md lists each endpoint's fields):

- a field omnirt serves is used;
- a field on the endpoint's *ignored* list is accepted and has no effect (what OpenAI's clients send
  that changes nothing here: `user`, `metadata`, `store`, `tracing`, ...);
- a field omnirt does not serve is accepted only at a value that asks for nothing (`tools: []`,
  `logprobs: false`, `response_format: {"type": "text"}`); any other value is refused, naming the field
  (`unsupported_parameter`), rather than silently ignored;
- any other field is refused as unknown (`unknown_parameter`), as OpenAI does.

Each protocol turns a `FieldError` into its own shape: a 400 JSON error, or a Realtime `error` event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class FieldError(ValueError):
    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(slots=True, frozen=True)
class FieldRule:
    served: frozenset[str]
    ignored: frozenset[str] = frozenset()
    inert: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # unserved field -> values that ask nothing

    def check(self, obj: Mapping[str, Any], where: str = "") -> None:
        """Raise FieldError for the first field of `obj` (named as `where.field`) that the rule refuses."""
        for key, value in obj.items():
            if key in self.served or key in self.ignored:
                continue
            name = f"{where}.{key}" if where else key
            if key not in self.inert:
                raise FieldError(f"unknown parameter `{name}`", name, "unknown_parameter")
            if not any(_same(value, ok) for ok in self.inert[key]):
                accepted = " or ".join(json.dumps(v) for v in self.inert[key])
                raise FieldError(f"`{name}` is not supported by omnirt: leave it out or send {accepted}", name,
                                 "unsupported_parameter")


def rule(served: Iterable[str], ignored: Iterable[str] = (), inert: Mapping[str, tuple[Any, ...]] | None = None
         ) -> FieldRule:
    return FieldRule(frozenset(served), frozenset(ignored), dict(inert or {}))


def _same(value: Any, ok: Any) -> bool:
    """Equal and of the same kind (`0` is not `false`, `1.0` is `1`)."""
    if isinstance(value, bool) or isinstance(ok, bool):
        return value is ok
    return value == ok
