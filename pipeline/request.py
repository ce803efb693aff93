"""Requests, their lifecycle, and the closed set of events the engine streams back.

Everything here crosses the engine boundary, so it holds plain Python data (ids, bytes, numpy
audio), never tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np

from pipeline.sampling import SamplingParams


class Part(TypedDict, total=False):
    type: str  # "text" | "audio"
    text: str
    audio: np.ndarray  # float32 mono at the engine's input_sample_rate


class Message(TypedDict):
    role: str  # "system" | "user" | "assistant"
    content: str | list[Part]


class RequestStatus(enum.IntEnum):
    """Only the owning stage's scheduler (and abort) changes it; finished states sort last."""

    WAITING = 0  # admitted, no slot yet
    WAITING_FOR_INPUT = 1  # holds a slot, waits for the upstream stage's next chunk
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class OmniRequest:
    """What a client asks of the engine."""

    request_id: str
    messages: list[Message]
    modalities: tuple[str, ...] = ("text",)
    voice: str | None = None
    thinker_sampling: dict[str, Any] = field(default_factory=dict)  # overrides of the profile defaults
    talker_sampling: dict[str, Any] = field(default_factory=dict)
    initial_codec_chunk_frames: int | None = None

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


@dataclass(slots=True)
class StageRequest:
    """A request's life inside one stage. Progress is counters, not phase flags."""

    request_id: str
    sampling: SamplingParams
    state: Any = None  # the model adapter's per-request data
    status: RequestStatus = RequestStatus.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    generator: Any = None  # torch.Generator when seeded
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens


# ---- events streamed to the caller of OmniEngine.submit() -------------------------------------------


@dataclass(slots=True, frozen=True)
class TextDelta:
    request_id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class AudioChunk:
    request_id: str
    pcm16: bytes  # mono little-endian int16 at OmniEngine.output_sample_rate
    index: int

    @property
    def num_samples(self) -> int:
        return len(self.pcm16) // 2


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_frames: int = 0


@dataclass(slots=True, frozen=True)
class Finished:
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    usage: Usage
    error: str | None = None


Event = TextDelta | AudioChunk | Finished


@dataclass(slots=True)
class Reply:
    """A whole reply gathered from an event stream (non-streaming clients, tests, benchmarks)."""

    text: str
    token_ids: list[int]
    pcm16: bytes
    finished: Finished | None


async def collect_reply(events) -> Reply:
    text, ids, pcm, fin = [], [], bytearray(), None
    async for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
            ids.extend(ev.token_ids)
        elif isinstance(ev, AudioChunk):
            pcm += ev.pcm16
        elif isinstance(ev, Finished):
            fin = ev
    return Reply("".join(text), ids, bytes(pcm), fin)
