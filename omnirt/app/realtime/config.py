"""The Realtime session and response settings: `session.update` / `response.create` bodies of either
generation (GA nested `audio.input/output`, beta flat fields) -> one frozen config, and back to the
`session` object each dialect expects.

Fields follow the one rule of `omnirt/app/fields.py` (docs/api-fields.md): what omnirt cannot do (out-of-band
`input`, another speed) is accepted only at a value that asks for nothing (so a
client may send back the `session` object it got) and refused with an `error` otherwise, as is any unknown
field. Input transcription has its own module (`omnirt/app/realtime/transcription.py`), tools theirs
(`omnirt/app/realtime/tool_config.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omnirt.app.audio.denoise import NOISE_REDUCTIONS
from omnirt.app.audio.turn_end import SemanticVadConfig
from omnirt.app.audio.vad import TurnDetection, VadConfig
from omnirt.app.audio.wire import FORMATS, FORMATS_BY_MIME, PCM16, AudioFormat
from omnirt.app.fields import FieldRule, rule
from omnirt.app.model_names import is_alias
from omnirt.app.realtime.events import ProtocolError, check_fields, require
from omnirt.app.realtime.tool_config import engine_tools, parse_tools
from omnirt.app.realtime.transcription import TranscriptionConfig, parse_transcription, transcription_object
from omnirt.pipeline.api import EngineInfo

MAX_OUTPUT_TOKENS = 4096
_ECHOED = ("type", "object", "id", "expires_at")  # parts of a session object a client may send back
_UNSERVED = {"prompt": (None,), "include": (None, []), "speed": (None, 1.0)}
SESSION_FIELDS = rule(
    ("audio", "instructions", "output_modalities", "modalities", "voice", "input_audio_format", "output_audio_format",
     "turn_detection", "temperature", "max_output_tokens", "max_response_output_tokens", "model", "truncation",
     "input_audio_transcription", "input_audio_noise_reduction", "tools", "tool_choice", "talker_sampling",
     "prefill_while_speaking"),
    ignored=(*_ECHOED, "tracing", "client_secret"), inert=_UNSERVED)
RESPONSE_FIELDS = rule(
    ("audio", "instructions", "output_modalities", "modalities", "voice", "output_audio_format", "temperature",
     "max_output_tokens", "max_response_output_tokens", "conversation", "metadata", "talker_sampling", "tools",
     "tool_choice"),
    ignored=_ECHOED, inert={**_UNSERVED, "input": (None, [])})
SESSION_AUDIO_FIELDS, RESPONSE_AUDIO_FIELDS = rule(("input", "output")), rule(("output",))
AUDIO_INPUT_FIELDS = rule(("format", "turn_detection", "transcription", "noise_reduction"))
AUDIO_OUTPUT_FIELDS = rule(("format", "voice"), inert={"speed": (None, 1.0)})
VAD_FIELDS = rule(("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                   "interrupt_response", "idle_timeout_ms"))
SEMANTIC_VAD_FIELDS = rule(("type", "eagerness", "create_response", "interrupt_response"))
NOISE_REDUCTION_FIELDS = rule(("type",))


@dataclass(slots=True, frozen=True)
class SessionConfig:
    model: str
    voice: str
    # or "transcription" (`omnirt.app.realtime.transcription_session`): transcribed, never answered
    type: str = "realtime"
    instructions: str = ""
    wants_audio: bool = True
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    turn_detection: TurnDetection | None = VadConfig()
    noise_reduction: str | None = None  # "near_field" or "far_field" (omnirt/app/audio/denoise.py); None: off
    temperature: float | None = None  # None: the deploy profile's default
    max_output_tokens: int | None = None  # None: "inf" (the profile's limit)
    truncation: Any = "auto"  # as the client set it: "auto", "disabled" or {"type": "retention_ratio", ...}
    transcription: TranscriptionConfig | None = None  # None: the user's audio is not transcribed
    tools: tuple[dict, ...] = ()  # as the client sent them ({type: function, name, description, parameters})
    tool_choice: Any = "auto"  # as the client sent it: "auto", "none", "required" or {type: function, name}
    talker_sampling: dict | None = None  # omnirt extension: every response's speech sampling unless it sets its own
    # omnirt extension: prefill the heard audio while the user speaks (`omnirt/app/realtime/speculation.py`)
    prefill_while_speaking: bool = True

    @property
    def retention(self) -> float | None:
        """The engine's `truncation`: the share of the room kept when the conversation overflows (None: off)."""
        if self.truncation == "disabled":
            return None
        return 1.0 if self.truncation == "auto" else self.truncation["retention_ratio"]


@dataclass(slots=True, frozen=True)
class ResponseOptions:
    instructions: str
    wants_audio: bool
    voice: str
    output_format: AudioFormat
    temperature: float | None
    max_output_tokens: int | None
    in_conversation: bool = True
    metadata: dict | None = None
    talker_sampling: dict | None = None  # omnirt extension (as in /v1/chat/completions)
    truncation: float | None = 1.0  # SessionConfig.retention
    tools: tuple[dict, ...] = ()  # the engine's shape: {type: function, function: {name, description, parameters}}
    tool_choice: str | dict = "auto"  # the engine's shape


def initial_config(info: EngineInfo, model: str, instructions: str) -> SessionConfig:
    """What a session starts with unless a client secret carries settings of its own."""
    return SessionConfig(model=model, voice=info.default_voice, instructions=instructions,
                         wants_audio=info.has_audio_output)


def apply_session_update(cfg: SessionConfig, update: dict[str, Any], voices: tuple[str, ...],
                         model_aliases: tuple[str, ...] = ()) -> SessionConfig:
    """`session.update`'s `session` over the current config; only the fields present change. Its `model` may
    name the session's model or one of `model_aliases` (`omnirt.app.model_names`): only another model is refused."""
    a_in, a_out = _fields(update, SESSION_FIELDS, SESSION_AUDIO_FIELDS, "session")
    # a session.update's: omnirt.app.realtime.transcription_session's first
    if update.get("type") not in (None, "realtime"):
        raise ProtocolError('`session.type` must be "realtime" here (a transcription session starts at connect with '
                            '`?intent=transcription`, or with a session.update)', "invalid_value", "session.type")
    model = require(update, "model", (str,), "session")
    if model not in (None, cfg.model) and not is_alias(model, model_aliases):
        raise ProtocolError(f"the model of a session cannot change ({cfg.model!r}, not {model!r})", "invalid_value",
                            "session.model")
    changes: dict[str, Any] = {}
    if "instructions" in update:
        changes["instructions"] = require(update, "instructions", (str,), "session", "")
    for key in ("output_modalities", "modalities"):
        if update.get(key) is not None:
            changes["wants_audio"] = _modalities(update[key], f"session.{key}")
    voice = _voice(update, a_out, "session", voices)
    if voice is not None:
        changes["voice"] = voice
    for key, fmt_key, ga in (("input_format", "input_audio_format", a_in), ("output_format", "output_audio_format",
                                                                             a_out)):
        fmt = _format(update.get(fmt_key), ga.get("format"), f"session.{fmt_key}")
        if fmt is not None:
            changes[key] = fmt
    for src, where in ((update, "session"), (a_in, "session.audio.input")):
        if "turn_detection" in src:
            changes["turn_detection"] = parse_turn_detection(src["turn_detection"], f"{where}.turn_detection")
    for src, key in ((update, "session.input_audio_noise_reduction"), (a_in, "session.audio.input.noise_reduction")):
        if (name := key.rpartition(".")[2]) in src:
            changes["noise_reduction"] = parse_noise_reduction(src[name], key)
    for src, key in ((update, "session.input_audio_transcription"), (a_in, "session.audio.input.transcription")):
        if (name := key.rpartition(".")[2]) in src:
            changes["transcription"] = parse_transcription(src[name], key, cfg.model)
    if update.get("temperature") is not None:
        changes["temperature"] = _temperature(update, "session")
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in update:
            changes["max_output_tokens"] = _max_tokens(update[key], f"session.{key}")
    if "truncation" in update:
        changes["truncation"] = _truncation(update["truncation"], "session.truncation")
    if "talker_sampling" in update:
        changes["talker_sampling"] = require(update, "talker_sampling", (dict,), "session")
    if "prefill_while_speaking" in update:
        changes["prefill_while_speaking"] = require(update, "prefill_while_speaking", (bool,), "session", True)
    tools = parse_tools(update, "session", cfg.tools)
    if "tools" in update or "tool_choice" in update:
        changes["tools"], changes["tool_choice"] = tools, update.get("tool_choice") or cfg.tool_choice
        engine_tools(tools, changes["tool_choice"], "session")  # checked now, refused with the update
    return dataclasses.replace(cfg, **changes)


def response_options(cfg: SessionConfig, body: dict[str, Any] | None, voices: tuple[str, ...]) -> ResponseOptions:
    """`response.create`'s `response` over the session defaults."""
    body = body or {}
    _, a_out = _fields(body, RESPONSE_FIELDS, RESPONSE_AUDIO_FIELDS, "response")
    wants_audio = cfg.wants_audio
    for key in ("output_modalities", "modalities"):
        if body.get(key) is not None:
            wants_audio = _modalities(body[key], f"response.{key}")
    conversation = require(body, "conversation", (str,), "response", "auto")
    if conversation not in ("auto", "none"):
        raise ProtocolError("response.conversation must be 'auto' or 'none'", "invalid_value", "response.conversation")
    max_tokens = cfg.max_output_tokens
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in body:
            max_tokens = _max_tokens(body[key], f"response.{key}")
    tools = parse_tools(body, "response", cfg.tools)
    tools, tool_choice = engine_tools(tools, body.get("tool_choice") or cfg.tool_choice, "response")
    return ResponseOptions(
        instructions=require(body, "instructions", (str,), "response", cfg.instructions),
        wants_audio=wants_audio, voice=_voice(body, a_out, "response", voices) or cfg.voice,
        output_format=_format(body.get("output_audio_format"), a_out.get("format"),
                              "response.output_audio_format") or cfg.output_format,
        temperature=_temperature(body, "response") if body.get("temperature") is not None else cfg.temperature,
        max_output_tokens=max_tokens, in_conversation=conversation == "auto",
        metadata=require(body, "metadata", (dict,), "response"),
        talker_sampling=require(body, "talker_sampling", (dict,), "response", cfg.talker_sampling),
        truncation=cfg.retention,
        tools=tools, tool_choice=tool_choice)


def parse_turn_detection(value: Any, where: str) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"`{where}` must be an object or null", "invalid_type", where)
    kind = value.get("type", "server_vad")
    if kind == "semantic_vad":
        return _semantic_vad(value, where)
    if kind != "server_vad":
        raise ProtocolError(f"turn detection {kind!r} is not supported; use 'server_vad', 'semantic_vad' or null",
                            "unsupported_parameter", f"{where}.type")
    check_fields(VAD_FIELDS, value, where)
    kw = {k: require(value, k, t, where) for k, t in (("threshold", (float, int)), ("prefix_padding_ms", (int,)),
                                                      ("silence_duration_ms", (int,)), ("create_response", (bool,)),
                                                      ("interrupt_response", (bool,)), ("idle_timeout_ms", (int,)))}
    try:
        return VadConfig(**{k: v for k, v in kw.items() if v is not None})
    except ValueError as exc:
        raise ProtocolError(f"{where}: {exc}", "invalid_value", where) from exc


def _semantic_vad(value: dict, where: str) -> SemanticVadConfig:
    check_fields(SEMANTIC_VAD_FIELDS, value, where)
    kw = {k: require(value, k, t, where) for k, t in (("eagerness", (str,)), ("create_response", (bool,)),
                                                      ("interrupt_response", (bool,)))}
    try:
        return SemanticVadConfig(**{k: v for k, v in kw.items() if v is not None})
    except ValueError as exc:
        raise ProtocolError(f"{where}.eagerness: {exc}", "invalid_value", f"{where}.eagerness") from exc


def turn_detection_object(td: TurnDetection | None) -> dict[str, Any] | None:
    """The session's `turn_detection` as OpenAI shows it."""
    if isinstance(td, SemanticVadConfig):
        return {"type": "semantic_vad", "eagerness": td.eagerness, "create_response": td.create_response,
                "interrupt_response": td.interrupt_response}
    return None if td is None else {"type": "server_vad", **dataclasses.asdict(td)}


def parse_noise_reduction(value: Any, where: str) -> str | None:
    """null (off) or {"type": "near_field" | "far_field"}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"`{where}` must be an object or null", "invalid_type", where)
    check_fields(NOISE_REDUCTION_FIELDS, value, where)
    if value.get("type") not in NOISE_REDUCTIONS:
        raise ProtocolError(f"`{where}.type` must be one of {', '.join(NOISE_REDUCTIONS)}", "invalid_value",
                            f"{where}.type")
    return value["type"]


def session_object(cfg: SessionConfig, session_id: str, beta: bool) -> dict[str, Any]:
    """The session as the client's protocol shows it, with omnirt's `talker_sampling` where one is set and
    `prefill_while_speaking` where it is off (its default keeps the object OpenAI's)."""
    obj = _protocol_session(cfg, session_id, beta)
    if cfg.talker_sampling is not None:
        obj["talker_sampling"] = cfg.talker_sampling
    if not cfg.prefill_while_speaking:
        obj["prefill_while_speaking"] = False
    return obj


def _protocol_session(cfg: SessionConfig, session_id: str, beta: bool) -> dict[str, Any]:
    td = turn_detection_object(cfg.turn_detection)
    noise = None if cfg.noise_reduction is None else {"type": cfg.noise_reduction}
    max_tokens = cfg.max_output_tokens or "inf"
    if beta:
        return {"id": session_id, "object": "realtime.session", "model": cfg.model,
                "modalities": ["text", "audio"] if cfg.wants_audio else ["text"], "instructions": cfg.instructions,
                "voice": cfg.voice, "input_audio_format": cfg.input_format.name,
                "output_audio_format": cfg.output_format.name,
                "input_audio_transcription": transcription_object(cfg.transcription),
                "input_audio_noise_reduction": noise, "turn_detection": td, "tools": list(cfg.tools),
                "tool_choice": cfg.tool_choice,
                "temperature": cfg.temperature,
                "max_response_output_tokens": max_tokens}
    return {"type": "realtime", "object": "realtime.session", "id": session_id, "model": cfg.model,
            "output_modalities": ["audio"] if cfg.wants_audio else ["text"], "instructions": cfg.instructions,
            "audio": {"input": {"format": format_object(cfg.input_format),
                                "transcription": transcription_object(cfg.transcription),
                                "noise_reduction": noise, "turn_detection": td},
                      "output": {"format": format_object(cfg.output_format), "voice": cfg.voice, "speed": 1.0}},
            "tools": list(cfg.tools), "tool_choice": cfg.tool_choice, "max_output_tokens": max_tokens, "tracing": None,
            "truncation": cfg.truncation, "prompt": None, "include": None}


def format_object(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": fmt.mime, "rate": fmt.sample_rate} if fmt is PCM16 else {"type": fmt.mime}


# ---- field parsers -------------------------------------------------------------------------------------


def _truncation(value: Any, where: str) -> Any:
    """"auto" (drop the oldest items when the conversation overflows the context), "disabled" (the response
    fails instead), or {"type": "retention_ratio", "retention_ratio": r}: drop down to r of the room."""
    if value in ("auto", "disabled"):
        return value
    ratio = value.get("retention_ratio") if isinstance(value, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "retention_ratio" and isinstance(ratio, int | float)
            and not isinstance(ratio, bool) and 0 < ratio <= 1):
        raise ProtocolError(f'`{where}` must be "auto", "disabled" or {{"type": "retention_ratio", '
                            '"retention_ratio": 0 < r <= 1}', "invalid_value", where)
    return {"type": "retention_ratio", "retention_ratio": float(ratio)}


def _fields(obj: dict, fields: FieldRule, audio_fields: FieldRule, where: str) -> tuple[dict, dict]:
    """The one rule over a session or response body and its `audio`; returns `audio.input`, `audio.output`."""
    check_fields(fields, obj, where)
    audio = require(obj, "audio", (dict,), where, {})
    check_fields(audio_fields, audio, f"{where}.audio")
    a_in = require(audio, "input", (dict,), f"{where}.audio", {})
    a_out = require(audio, "output", (dict,), f"{where}.audio", {})
    check_fields(AUDIO_INPUT_FIELDS, a_in, f"{where}.audio.input")
    check_fields(AUDIO_OUTPUT_FIELDS, a_out, f"{where}.audio.output")
    return a_in, a_out


def _modalities(value: Any, where: str) -> bool:
    if not isinstance(value, list) or not value or any(m not in ("text", "audio") for m in value):
        raise ProtocolError(f"`{where}` must be [\"audio\"], [\"text\"] or [\"text\", \"audio\"]", "invalid_value",
                            where)
    return "audio" in value


def _voice(flat: dict, audio_out: dict, where: str, voices: tuple[str, ...]) -> str | None:
    voice = require(flat, "voice", (str,), where) or require(audio_out, "voice", (str,), f"{where}.audio.output")
    if voice is not None and voice.lower() not in voices:
        raise ProtocolError(f"unknown voice {voice!r}; available: {', '.join(voices)}", "invalid_voice",
                            f"{where}.voice")
    return None if voice is None else voice.lower()


def _format(beta: Any, ga: Any, where: str) -> AudioFormat | None:
    if beta is not None:
        if not isinstance(beta, str) or beta not in FORMATS:
            raise ProtocolError(f"`{where}` must be one of {', '.join(FORMATS)}", "invalid_value", where)
        return FORMATS[beta]
    if ga is None:
        return None
    if not isinstance(ga, dict) or not isinstance(ga.get("type"), str) or ga["type"] not in FORMATS_BY_MIME:
        raise ProtocolError(f"audio format must be {{type: {' | '.join(FORMATS_BY_MIME)}}}", "invalid_value", where)
    fmt = FORMATS_BY_MIME[ga["type"]]
    if ga.get("rate") not in (None, fmt.sample_rate):
        raise ProtocolError(f"{fmt.mime} is {fmt.sample_rate} Hz only", "invalid_value", where)
    return fmt


def _temperature(obj: dict, where: str) -> float:
    t = float(require(obj, "temperature", (float, int), where))
    if not 0.0 <= t <= 2.0:
        raise ProtocolError("temperature must be between 0 and 2", "invalid_value", f"{where}.temperature")
    return t


def _max_tokens(value: Any, where: str) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ProtocolError(f"`{where}` must be an integer 1..{MAX_OUTPUT_TOKENS} or \"inf\"", "invalid_value", where)
    return value
