"""Transcription sessions (`session.type: "transcription"`): the input audio becomes user items, each
transcribed by the Thinker (`omnirt.app.realtime.transcription`); no response is ever generated.

A session becomes one when it connects with `?intent=transcription`, on a GA `session.update` with
`type: "transcription"`, or on the beta `transcription_session.update`; it stays one. Its fields are a
subset of a realtime session's (GA `audio.input.{format, transcription, turn_detection, noise_reduction}`;
beta `input_audio_format`, `input_audio_transcription`, `turn_detection`, `input_audio_noise_reduction`),
parsed by the same code (`omnirt.app.realtime.config`), so every turn detection and input setting a realtime
session serves is served here too. Transcription is on from the start (the served model), and turn detection
never creates or interrupts a response. Its session object is `session.created/updated` with
`type: "transcription"` (GA), or `transcription_session.created/updated` (beta).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnirt.app.audio.vad import VadConfig
from omnirt.app.fields import rule
from omnirt.app.realtime.config import SessionConfig, apply_session_update, session_object
from omnirt.app.realtime.events import ProtocolError, check_fields, require
from omnirt.app.realtime.transcription import TranscriptionConfig

TRANSCRIPTION = "transcription"
_SHARED = ("audio", "input_audio_format", "input_audio_transcription", "turn_detection", "input_audio_noise_reduction")
FIELDS = rule(("type", *_SHARED), ignored=("object", "id", "expires_at", "client_secret", "modalities"),
              inert={"include": (None, [])})
AUDIO_FIELDS = rule(("input",))
_RESPONDING = ("create_response", "interrupt_response")  # turn detection settings about responses: none here


def apply_update(cfg: SessionConfig, update: dict[str, Any], voices: tuple[str, ...],
                 model_aliases: tuple[str, ...] = ()) -> SessionConfig:
    """`session.update`'s `session` of either type over the current config (type left out: the session's)."""
    kind = require(update, "type", (str,), "session", cfg.type)
    if kind not in ("realtime", TRANSCRIPTION):
        raise ProtocolError('`session.type` must be "realtime" or "transcription"', "invalid_value", "session.type")
    if cfg.type == TRANSCRIPTION and kind != TRANSCRIPTION:
        raise ProtocolError("a transcription session cannot become a realtime session; open a new one",
                            "invalid_value", "session.type")
    if kind != TRANSCRIPTION:
        return apply_session_update(cfg, update, voices, model_aliases)
    check_fields(FIELDS, update, "session")
    check_fields(AUDIO_FIELDS, require(update, "audio", (dict,), "session", {}), "session.audio")
    new = apply_session_update(as_transcription(cfg), {k: v for k, v in update.items() if k in _SHARED}, voices)
    for td, where in ((update.get("turn_detection"), "session.turn_detection"),
                      (((update.get("audio") or {}).get("input") or {}).get("turn_detection"),
                       "session.audio.input.turn_detection")):
        for key in _RESPONDING:
            if isinstance(td, dict) and td.get(key) is True:
                raise ProtocolError(f"a transcription session generates no responses: leave `{where}.{key}` out or "
                                    "send false", "unsupported_parameter", f"{where}.{key}")
    return dataclasses.replace(new, turn_detection=_silent(new.turn_detection))


def as_transcription(cfg: SessionConfig, model: str | None = None) -> SessionConfig:
    """A session's settings turned into a transcription session's: transcription on (`model` names the
    transcriber; default the session's model) unless already set, and turn detection that never responds."""
    if cfg.type == TRANSCRIPTION:
        return cfg
    transcription = cfg.transcription or TranscriptionConfig(model or cfg.model)
    return dataclasses.replace(cfg, type=TRANSCRIPTION, transcription=transcription,
                               turn_detection=_silent(cfg.turn_detection))


def session_event(cfg: SessionConfig, session_id: str, beta: bool, kind: str) -> tuple[str, dict[str, Any]]:
    """The `session.created` / `session.updated` event's type and session (`kind`: created or updated)."""
    if cfg.type != TRANSCRIPTION:
        return f"session.{kind}", session_object(cfg, session_id, beta)
    full = session_object(cfg, session_id, beta)
    if beta:
        return f"transcription_session.{kind}", {
            "id": session_id, "object": "realtime.transcription_session", "modalities": ["text"],
            "input_audio_format": full["input_audio_format"],
            "input_audio_transcription": full["input_audio_transcription"],
            "turn_detection": _without_responses(full["turn_detection"]),
            "input_audio_noise_reduction": full.get("input_audio_noise_reduction"), "include": None}
    a_in = full["audio"]["input"]
    return f"session.{kind}", {
        "type": TRANSCRIPTION, "object": "realtime.transcription_session", "id": session_id,
        "audio": {"input": {**a_in, "turn_detection": _without_responses(a_in["turn_detection"])}}, "include": None}


def _silent(td: VadConfig | None) -> VadConfig | None:
    return None if td is None else dataclasses.replace(td, create_response=False, interrupt_response=False)


def _without_responses(td: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if td is None else {k: v for k, v in td.items() if k not in _RESPONDING}
