"""The engine's one door: the only module `omnirt/app/` imports from `omnirt/pipeline/`.

An `EngineClient` takes requests and streams their events back, whether the engine runs in this process
(`InprocClient`) or in an engine core process of its own (`CoreClient`, the default where a device is used).
The request, event, error, info and options types live one floor down, in `omnirt/pipeline/types.py`, and are
offered here under the same names. Importing this module loads neither torch nor the models.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from omnirt.pipeline.config import ProfileError
from omnirt.pipeline.models import model_spec
from omnirt.pipeline.profile import check_options as check_profile
from omnirt.pipeline.serving.client import CoreClient, CoreHandle, CoreProcess, InprocClient
from omnirt.pipeline.types import (
    ATTENTION,
    COMPILE,
    CONV_BACKENDS,
    DISTRIBUTED,
    DTYPES,
    FIRST_OUTPUT_BUCKETS_S,
    MOE_BACKENDS,
    PLATFORMS,
    AudioChunk,
    EngineDeadError,
    EngineHealth,
    EngineInfo,
    EngineOptions,
    EngineOverloaded,
    EngineStartError,
    EngineStats,
    Event,
    Finished,
    FrontEndLimits,
    Message,
    OmniRequest,
    Part,
    RequestError,
    StageLimit,
    StageStats,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)

__all__ = [  # what omnirt/app/ may use: the client protocol, its factories, and the types it speaks
    "ATTENTION", "COMPILE", "CONV_BACKENDS", "DISTRIBUTED", "DTYPES", "FIRST_OUTPUT_BUCKETS_S", "MOE_BACKENDS",
    "PLATFORMS", "AudioChunk", "CoreHandle", "EngineClient", "EngineDeadError", "EngineHealth", "EngineInfo",
    "EngineOptions", "EngineOverloaded", "EngineStartError", "EngineStats", "Event", "Finished", "FrontEndLimits",
    "Message", "OmniRequest", "Part", "Reply", "RequestError", "StageLimit", "StageStats", "TextDelta", "ToolCall",
    "ToolCallDelta", "Usage", "check_options", "collect_reply", "connect_engine", "start_core", "start_engine",
]


class EngineClient(Protocol):
    """What `omnirt/app/` may ask of the engine. `submit` raises RequestError or EngineOverloaded before
    anything starts; the stream always ends with one `Finished`."""

    def info(self) -> EngineInfo: ...

    def submit(self, req: OmniRequest) -> Awaitable[AsyncIterator[Event]]:
        """The request counts from the call: an `abort` right after it, even before it is awaited,
        ends it."""

    def abort(self, request_id: str, error: str | None = None) -> None: ...

    def abort_all(self, error: str) -> None: ...

    def check_admission(self, wants_audio: bool = True) -> None: ...

    @property
    def num_active_requests(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def health(self) -> EngineHealth: ...

    async def wait_dead(self) -> str: ...

    def stop(self) -> None: ...


# ---- starting an engine ----------------------------------------------------------------------------------


def check_options(opts: EngineOptions) -> None:
    """The profile and engine flags as the engine will read them, on every platform it may detect, checked
    without importing torch, so that `omnirt serve` stops on a bad value before the model loads. Raises
    EngineStartError naming the key, the file and line or the flag it came from, and what is accepted."""
    try:
        check_profile(opts, model_spec(opts.model))
    except ProfileError as exc:
        raise EngineStartError(str(exc)) from exc


def start_engine(opts: EngineOptions, log_setup: Callable[[str, str], None] | None = None) -> EngineClient:
    """Build, load and start the engine, in this process or in an engine core process (`opts.process`;
    auto: a core process). `log_setup(level, format)` configures logging in the core process.
    Raises EngineStartError with a message for the user."""
    if opts.process == "inproc":
        return InprocClient.start(opts)
    return CoreClient.start(opts, log_setup)


def start_core(opts: EngineOptions, num_clients: int,
               log_setup: Callable[[str, str], None] | None = None) -> CoreProcess:
    """The engine core in a process of its own for `num_clients` API processes (`--api-workers`): a
    `CoreProcess`; `handle(k)` is what API process k passes to `connect_engine`. Raises EngineStartError."""
    return CoreProcess.start(opts, num_clients, log_setup)


def connect_engine(handle: CoreHandle) -> EngineClient:
    """An API process's client of a core another process started (`start_core(...).handle(k)`)."""
    return CoreClient.connect(handle)


@dataclass(slots=True)
class Reply:
    """A whole reply gathered from an event stream (non-streaming clients, tests, benchmarks)."""

    text: str
    token_ids: list[int]
    pcm16: bytes
    finished: Finished | None
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"} of each call, in order


async def collect_reply(events: AsyncIterator[Event]) -> Reply:
    text, ids, pcm, fin, calls = [], [], bytearray(), None, []
    async for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
            ids.extend(ev.token_ids)
        elif isinstance(ev, ToolCallDelta):
            if ev.name is not None:
                calls.append({"id": ev.call_id, "name": ev.name, "arguments": ""})
            calls[ev.index]["arguments"] += ev.arguments
        elif isinstance(ev, AudioChunk):
            pcm += ev.pcm16
        elif isinstance(ev, Finished):
            fin = ev
    return Reply("".join(text), ids, bytes(pcm), fin, calls)
