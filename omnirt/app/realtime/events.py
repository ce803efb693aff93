"""OpenAI Realtime event shapes: client-event validation, the GA -> beta renaming of server events,
and the `error` event. Everything here is plain dicts; no state.

Client events of both generations are accepted whatever the dialect (they are almost identical);
server events are built with GA names and renamed on the way out for a beta session.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from omnirt.app.fields import FieldError, FieldRule, rule

# field -> (accepted types, required)
_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "session.update": {"session": ((dict,), True)},
    "transcription_session.update": {"session": ((dict,), True)},  # beta (omnirt/app/realtime/transcription_session.py)
    "input_audio_buffer.append": {"audio": ((str,), True)},
    "input_audio_buffer.commit": {},
    "input_audio_buffer.clear": {},
    "conversation.item.create": {"item": ((dict,), True), "previous_item_id": ((str,), False)},
    "conversation.item.truncate": {"item_id": ((str,), True), "content_index": ((int,), True),
                                   "audio_end_ms": ((int,), True)},
    "conversation.item.delete": {"item_id": ((str,), True)},
    "conversation.item.retrieve": {"item_id": ((str,), True)},
    "response.create": {"response": ((dict,), False)},
    "response.cancel": {"response_id": ((str,), False)},
    "output_audio_buffer.clear": {"response_id": ((str,), False)},
}
CLIENT_EVENT_TYPES = tuple(_FIELDS)
_EVENT_FIELDS = {kind: rule(("type", "event_id", *fields)) for kind, fields in _FIELDS.items()}

# GA server event name -> beta name (None: the beta protocol has no such event)
_BETA_NAMES: dict[str, str | None] = {
    "conversation.item.added": "conversation.item.created",
    "conversation.item.done": None,
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
}
AUDIO_DELTA = "response.output_audio.delta"


class ProtocolError(Exception):
    """A client event that cannot be applied; it becomes an `error` event and the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.error_type = message, code, param, error_type


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class _Append(msgspec.Struct, forbid_unknown_fields=True):
    """`input_audio_buffer.append`, the event a microphone sends 50 times a second, as it must be."""

    type: Literal["input_audio_buffer.append"]
    audio: str
    event_id: str | None | msgspec.UnsetType = msgspec.UNSET


_APPEND = msgspec.json.Decoder(_Append)


def parse_client_event(raw: str | bytes) -> dict[str, Any]:
    """JSON text -> a JSON object (checked by `validate_client_event`); raises ProtocolError otherwise. A
    well-formed append decodes in one pass of msgspec's typed decoder (a quarter of `json.loads`' time); anything
    else (another event, a malformed one) takes the general path, so that its object or its error is the same."""
    try:
        append = _APPEND.decode(raw)
    except msgspec.MsgspecError:
        return _parse_json_object(raw)
    event = {"type": append.type, "audio": append.audio}
    if append.event_id is not msgspec.UNSET:
        event["event_id"] = append.event_id
    return event


def _parse_json_object(raw: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the event is not valid JSON ({exc.__class__.__name__})", "invalid_json") from exc
    if not isinstance(event, dict):
        raise ProtocolError("an event must be a JSON object", "invalid_event")
    return event


def validate_client_event(event: dict[str, Any]) -> None:
    kind = event.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("the event has no string `type`", "invalid_event", "type")
    if "event_id" in event and not isinstance(event["event_id"], str | None):
        raise ProtocolError("`event_id` must be a string", "invalid_type", "event_id")
    fields = _FIELDS.get(kind)
    if fields is None:
        raise ProtocolError(f"unknown event type {kind!r}", "invalid_event_type", "type")
    check_fields(_EVENT_FIELDS[kind], event, "")
    for name, (types, required) in fields.items():
        value = event.get(name)
        if value is None:
            if required:
                raise ProtocolError(f"{kind}: `{name}` is required", "missing_required_parameter", name)
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(t.__name__ for t in types).replace("dict", "object").replace("str", "string")
            raise ProtocolError(f"{kind}: `{name}` must be {want}, got {type(value).__name__}", "invalid_type",
                                name)


def to_beta(event: dict[str, Any]) -> dict[str, Any] | None:
    """A GA server event under its beta name (None: not sent to beta clients)."""
    kind = event["type"]
    if kind not in _BETA_NAMES:
        return event
    beta = _BETA_NAMES[kind]
    return None if beta is None else {**event, "type": beta}


def error_event(exc: ProtocolError, client_event_id: str | None = None) -> dict[str, Any]:
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": exc.error_type, "code": exc.code, "message": exc.message, "param": exc.param,
                      "event_id": client_event_id}}


def check_fields(fields: FieldRule, obj: dict, where: str) -> None:
    """The one rule of `omnirt/app/fields.py` over `obj`, its refusal as a ProtocolError."""
    try:
        fields.check(obj, where)
    except FieldError as exc:
        raise ProtocolError(exc.message, exc.code, exc.param) from exc


def require(obj: dict, key: str, types: tuple[type, ...], where: str, default: Any = None) -> Any:
    """A nested field with a type check: the same error shape at every depth."""
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("number" if t is float else t.__name__ for t in types)
        raise ProtocolError(f"`{where}.{key}` must be {names}", "invalid_type", f"{where}.{key}")
    return value
