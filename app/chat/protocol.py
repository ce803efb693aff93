"""The request shapes of POST /v1/chat/completions (OpenAI's), and their translation to engine terms."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.audio.pcm import AudioFormatError, decode_audio_file
from app.audio.resample import resample
from app.errors import APIError


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored


class InputAudio(_Open):
    data: str
    format: str = "wav"


class ContentPart(_Open):
    type: Literal["text", "input_audio"]
    text: str | None = None
    input_audio: InputAudio | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    audio: dict[str, Any] | None = None  # a previous assistant audio reference: the transcript is in content


class AudioParams(_Open):
    voice: str | None = None
    format: Literal["wav", "pcm16"] = "wav"


class StreamOptions(_Open):
    include_usage: bool = False


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
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension: no end of text before this many
    n: int = Field(default=1, ge=1, le=1)
    # omnirt extensions (vLLM-Omni names): per-stage talker sampling, first audio chunk size
    talker_sampling: dict[str, Any] | None = None
    initial_codec_chunk_frames: int | None = Field(default=None, ge=1, le=64)

    def thinker_overrides(self) -> dict[str, Any]:
        out = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
               "max_tokens": self.max_completion_tokens or self.max_tokens, "min_tokens": self.min_tokens}
        return {k: v for k, v in out.items() if v is not None}


def to_engine_messages(messages: list[ChatMessage], input_rate: int, max_audio_s: float) -> list[dict]:
    """OpenAI messages -> engine messages; audio parts decoded and resampled to the Thinker's rate."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "tool":
            role = "user"
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts = [_part(p, f"messages.{i}.content.{j}", input_rate, max_audio_s) for j, p in enumerate(m.content)]
        out.append({"role": role, "content": parts})
    return out


def _part(p: ContentPart, where: str, input_rate: int, max_audio_s: float) -> dict:
    if p.type == "text":
        if p.text is None:
            raise APIError(400, f"{where}.text is required for a text part", f"{where}.text", "invalid_value")
        return {"type": "text", "text": p.text}
    if p.input_audio is None:
        raise APIError(400, f"{where}.input_audio is required", f"{where}.input_audio", "invalid_value")
    if p.input_audio.format not in ("wav", "flac"):
        raise APIError(400, f"input audio format {p.input_audio.format!r} is not supported (wav, flac)",
                       f"{where}.input_audio.format", "unsupported_audio_format")
    try:
        raw = base64.b64decode(p.input_audio.data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, "input_audio.data is not valid base64", f"{where}.input_audio.data",
                       "invalid_base64") from exc
    try:
        samples, rate = decode_audio_file(raw)
    except AudioFormatError as exc:
        raise APIError(400, f"input_audio.data: {exc}", f"{where}.input_audio.data",
                       "invalid_audio") from exc
    if samples.size / rate > max_audio_s:
        raise APIError(400, f"input audio is {samples.size / rate:.1f} s; the limit is {max_audio_s:.0f} s",
                       f"{where}.input_audio.data", "audio_too_long")
    return {"type": "audio", "audio": resample(samples, rate, input_rate)}
