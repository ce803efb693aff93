"""The request shapes of POST /v1/chat/completions (OpenAI's), the fields each accepts (the one rule of
`omnirt/app/fields.py`), and their translation to engine terms."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from omnirt.app.audio.files import INPUT_FORMATS, OUTPUT_FORMATS, AudioTooLong, decode_file
from omnirt.app.audio.pcm import AudioFormatError
from omnirt.app.audio.resample import resample
from omnirt.app.errors import APIError
from omnirt.app.fields import FieldError, FieldRule, rule
from omnirt.app.images import DETAILS, ImageError, ImageLimits, decode_data_url
from omnirt.app.tool_checks import FUNCTION_NAME

NO_LIST, NO_MAP = (None, []), (None, {})  # an unserved field at one of these asks for nothing


class _Open(BaseModel):
    """Other fields pass pydantic and are judged by `fields` (`check_fields`): ignored, inert or refused."""

    model_config = ConfigDict(extra="allow")
    fields: ClassVar[FieldRule] = rule(())


class InputAudio(_Open):
    data: str
    format: str = "wav"


class ImageURL(_Open):
    url: str  # a data URL: the server fetches nothing
    detail: str = "auto"  # one of DETAILS (checked with the part, for an error naming it): accepted, no effect


class ContentPart(_Open):
    type: Literal["text", "input_audio", "image_url"]
    text: str | None = None
    input_audio: InputAudio | None = None
    image_url: ImageURL | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: forced calls always follow the schema; free ones are not checked


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class JSONSchemaFormat(_Open):
    name: str = Field(pattern=FUNCTION_NAME)
    schema_: dict[str, Any] = Field(alias="schema", default_factory=dict)
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCallItem(_Open):
    """An assistant's call as the SDK sends it back (`message.tool_calls`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    audio: dict[str, Any] | None = None  # a previous assistant audio reference: the transcript is in content
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls, sent back with the tools' results
    # what the SDK echoes back from an earlier reply (`message.model_dump()`), and tool bookkeeping (Qwen's
    # template pairs results with calls by their order, not by id)
    fields = rule((), ignored=("name", "refusal", "annotations", "tool_call_id"), inert={"function_call": (None,)})


class AudioParams(_Open):
    voice: str | None = None
    format: Literal[OUTPUT_FORMATS] = "wav"


class StreamOptions(_Open):
    include_usage: bool = False
    fields = rule((), ignored=("include_obfuscation",))  # no obfuscation padding is ever added


class ChatRequest(_Open):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"], min_length=1)
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    # vLLM's extensions: no end of text before min_tokens; top-k; repetition penalty
    min_tokens: int | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    # omnirt extensions (vLLM-Omni names): per-stage talker sampling, first audio chunk size
    talker_sampling: dict[str, Any] | None = None
    initial_codec_chunk_frames: int | None = Field(default=None, ge=1, le=64)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # checked by omnirt/app/chat/tools.py, for a clear error
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    fields = rule((), ignored=("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"),
                  inert={"functions": NO_LIST, "function_call": (None, "none", "auto"),
                         "logprobs": (None, False), "top_logprobs": (None, 0), "frequency_penalty": (None, 0),
                         "presence_penalty": (None, 0), "logit_bias": NO_MAP, "stop": (None, [], ""),
                         "prediction": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
                         "verbosity": (None,)})

    def thinker_overrides(self) -> dict[str, Any]:
        out = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
               "repetition_penalty": self.repetition_penalty,
               "max_tokens": self.max_completion_tokens or self.max_tokens, "min_tokens": self.min_tokens}
        return {k: v for k, v in out.items() if v is not None}


def check_fields(model: _Open, where: str = "") -> None:
    """The one rule over the request and every object in it; APIError 400 naming the first field it refuses."""
    try:
        model.fields.check(model.model_extra or {}, where)
    except FieldError as exc:
        raise APIError(400, exc.message, exc.param, exc.code) from exc
    for name in model.model_fields_set:
        value = getattr(model, name)
        for key, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if isinstance(item, _Open):
                check_fields(item, ".".join(str(p) for p in (where, name, key) if p not in ("", None)))


def to_engine_messages(messages: list[ChatMessage], input_rate: int, max_audio_s: float,
                       images: ImageLimits) -> list[dict]:
    """OpenAI messages -> engine messages; audio parts decoded and resampled to the Thinker's rate, images decoded
    to RGB pixels (at most `images.max_images`, in user messages only)."""
    _check_images(messages, images)
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            msg = {"role": role, "content": m.content or ""}
        else:
            msg = {"role": role, "content": [_part(p, f"messages.{i}.content.{j}", input_rate, max_audio_s, images)
                                              for j, p in enumerate(m.content)]}
        if m.tool_calls:
            msg["tool_calls"] = engine_tool_calls(m.tool_calls, f"messages.{i}.tool_calls")
        out.append(msg)
    return out


def engine_tool_calls(calls: list[ToolCallItem], where: str) -> list[dict]:
    """An assistant message's calls for the prompt; each call's arguments must be JSON text."""
    for j, call in enumerate(calls):
        try:
            json.loads(call.function.arguments)
        except ValueError as exc:
            raise APIError(400, f"{where}.{j}.function.arguments is not JSON", f"{where}.{j}.function.arguments",
                           "invalid_value") from exc
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


def _check_images(messages: list[ChatMessage], limits: ImageLimits) -> None:
    where = [(f"messages.{i}.content.{j}", m.role) for i, m in enumerate(messages) if isinstance(m.content, list)
             for j, p in enumerate(m.content) if p.type == "image_url"]
    for param, role in where:
        if role != "user":
            raise APIError(400, f"a {role} message cannot hold an image (only user messages can)", param,
                           "invalid_value")
    if len(where) > limits.max_images:
        raise APIError(400, f"the request holds {len(where)} images, more than the limit of {limits.max_images}",
                       where[limits.max_images][0], "too_many_images")


def _part(p: ContentPart, where: str, input_rate: int, max_audio_s: float, images: ImageLimits) -> dict:
    if p.type == "text":
        if p.text is None:
            raise APIError(400, f"{where}.text is required for a text part", f"{where}.text", "invalid_value")
        return {"type": "text", "text": p.text}
    if p.type == "image_url":
        return _image_part(p, where, images)
    if p.input_audio is None:
        raise APIError(400, f"{where}.input_audio is required", f"{where}.input_audio", "invalid_value")
    fmt = p.input_audio.format
    if fmt not in INPUT_FORMATS:
        raise APIError(400, f"input audio format {fmt!r} is not supported ({', '.join(INPUT_FORMATS)})",
                       f"{where}.input_audio.format", "unsupported_audio_format")
    try:
        raw = base64.b64decode(p.input_audio.data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, "input_audio.data is not valid base64", f"{where}.input_audio.data",
                       "invalid_base64") from exc
    try:
        samples, rate = decode_file(raw, fmt, max_audio_s)
    except AudioTooLong as exc:
        raise APIError(400, f"input audio is longer than the limit of {max_audio_s:g} s", f"{where}.input_audio.data",
                       "audio_too_long") from exc
    except AudioFormatError as exc:
        raise APIError(400, f"input_audio.data: {exc}", f"{where}.input_audio.data", "invalid_audio") from exc
    return {"type": "audio", "audio": resample(samples, rate, input_rate)}


def _image_part(p: ContentPart, where: str, limits: ImageLimits) -> dict:
    if p.image_url is None:
        raise APIError(400, f"{where}.image_url is required for an image_url part", f"{where}.image_url",
                       "invalid_value")
    if p.image_url.detail not in DETAILS:
        raise APIError(400, f"image_url.detail must be one of {', '.join(DETAILS)}", f"{where}.image_url.detail",
                       "invalid_value")
    try:
        return {"type": "image", "image": decode_data_url(p.image_url.url, limits)}
    except ImageError as exc:
        raise APIError(400, exc.message, f"{where}.image_url.url", exc.code) from exc
