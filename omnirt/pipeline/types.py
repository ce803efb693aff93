"""The bottom floor of the engine: the request, event, usage, error, info/stats and options types.

Everything in `omnirt/pipeline/` and the API process speaks these; this module imports nothing of ours (and no
torch), so it can sit under every other. The request, event, info and stats types are msgspec structs: they
cross the process boundary between the API process and the engine core as typed messages
(`omnirt/pipeline/serving/ipc.py`). `omnirt/app/` reaches them through the door, `omnirt/pipeline/api.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

import msgspec
import numpy as np

# ---- the values the engine's options accept (checked in omnirt/pipeline/config.py, offered by the command line) ----

PLATFORMS = ("cuda", "rocm", "npu", "xpu", "cpu")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("auto", "slots", "dense")
COMPILE = ("auto", "on", "off")
CONV_BACKENDS = ("native", "gemm", "channels_last", "triton")  # the vocoder's (models/qwen3_omni/convolutions.py)
MOE_BACKENDS = ("auto", "grouped_mm", "batched_mm", "eager", "triton")  # triton: omnirt/pipeline/kernels/moe.py
QUANTIZATIONS = ("none", "fp8", "auto")  # fp8: the experts' weights, block-scaled (omnirt/pipeline/kernels/fp8.py)
DISTRIBUTED = ("none", "ray")


class Part(TypedDict, total=False):
    type: str  # "text" | "audio" | "image"
    text: str
    audio: np.ndarray  # float32 mono at EngineInfo.input_sample_rate
    image: np.ndarray  # uint8 RGB [height, width, 3] (alpha composited on white), only in user messages


class ToolCall(TypedDict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class Message(TypedDict):
    role: str  # "system" | "user" | "assistant" | "tool" (a tool's result)
    content: str | list[Part]
    tool_calls: NotRequired[list[ToolCall]]  # an assistant message's calls, after its content (the template renders)
    tool_call_id: NotRequired[str]  # a tool message's call


class OmniRequest(msgspec.Struct, tag=True):
    """What a client asks of the engine."""

    request_id: str
    messages: list[dict]  # Message dicts; audio and image parts hold numpy arrays
    modalities: tuple[str, ...] = ("text",)
    voice: str | None = None
    thinker_sampling: dict[str, Any] = msgspec.field(default_factory=dict)  # overrides of the profile defaults
    talker_sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    initial_codec_chunk_frames: int | None = None
    # None: a prompt too long for the context fails the request. r in (0, 1]: the oldest messages after
    # the leading system ones are left out until the rest fits within r of what the context leaves for
    # them (after each stage's output budget); `Finished.truncated_messages` says how many.
    truncation: float | None = None
    # requests reuse each other's KV prefixes only within one salt (the server passes the API key's id, so
    # that one tenant's prompts never warm, or reveal, another's); None is a salt of its own
    cache_salt: str | None = None
    # function tools in OpenAI's shape ({"type": "function", "function": {name, description, parameters}});
    # tool_choice "auto" (the model decides; its calls are parsed from the text), "none" (tools left out of
    # the prompt), "required" or {"type": "function", "function": {"name": ...}} (a call is forced by grammar)
    tools: list[dict] = msgspec.field(default_factory=list)
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    # {"type": "json_object"} or {"type": "json_schema", "schema": {...}}: the text follows it (by grammar)
    response_format: dict | None = None
    # no client waits on its first packet (a transcript of the user): with first-packet priority the stages
    # serve it after the requests still owed theirs, like any running request (aging keeps it moving)
    background: bool = False
    # teacher forcing, per stage name: step k emits forced[stage][k] instead of sampling (`SamplingParams.forced`);
    # the parity check's (`omnirt/loadtest/gpu/hf_parity.py`), which no client sets
    forced: dict[str, tuple] = msgspec.field(default_factory=dict)
    # speculative prefill of a turn still being spoken: the messages end with the audio heard so far, and the
    # engine prefills the prompt up to the last settled window of that audio (`EngineInfo.num_settled_windows`;
    # no closing tokens), then ends with `Finished` alone: no reply, no speech, served after every request
    # owed output. Its KV stays resident for the turn's real request, which prefills only the rest.
    prefill_only: bool = False

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities and not self.prefill_only


# ---- events: the closed set a request's stream yields ------------------------------------------------


class TextDelta(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    text: str
    token_ids: tuple[int, ...]


class ToolCallDelta(msgspec.Struct, frozen=True, tag=True):
    """A piece of the reply's `index`th tool call: the first one names it (call_id, name, arguments ""),
    the next ones carry pieces of its arguments (JSON text), in order."""

    request_id: str
    index: int
    arguments: str
    call_id: str | None = None
    name: str | None = None


class AudioChunk(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    pcm16: bytes  # mono little-endian int16 at EngineInfo.output_sample_rate
    index: int

    @property
    def num_samples(self) -> int:
        return len(self.pcm16) // 2


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_frames: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those whose KV an earlier request left (not prefilled)
    prompt_audio_tokens: int = 0  # of the prompt tokens, the input audio's placeholders (one per encoder frame)
    prompt_image_tokens: int = 0  # of the prompt tokens, the input images' placeholders (one per merged patch)

    @property
    def prompt_text_tokens(self) -> int:
        return self.prompt_tokens - self.prompt_audio_tokens - self.prompt_image_tokens


class Finished(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    finish_reason: str  # "stop" | "tool_calls" (stopped after calling tools) | "length" | "abort" | "error"
    usage: Usage
    error: str | None = None
    truncated_messages: int = 0  # leading conversation messages the prompt left out (OmniRequest.truncation)


Event = TextDelta | ToolCallDelta | AudioChunk | Finished


# ---- errors ------------------------------------------------------------------------------------------


class RequestError(ValueError):
    """The request cannot be served as asked (bad voice, prompt too long, bad sampling values, a schema
    that cannot be compiled for constrained decoding)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.code = param, code


class EngineOverloaded(RuntimeError):
    """Every slot and wait place of a stage is taken; the caller should retry after `retry_after_s`."""

    def __init__(self, stage: str, capacity: int, retry_after_s: float):
        super().__init__(f"the {stage} stage is full ({capacity} requests running or waiting); retry later")
        self.stage, self.capacity, self.retry_after_s = stage, capacity, retry_after_s


class EngineDeadError(RuntimeError):
    """The engine core process is gone; nothing more can be served."""


class EngineStartError(RuntimeError):
    """The engine could not start (bad profile, model not found, a missing extra, a crash while loading)."""


class ModelNotFoundError(FileNotFoundError):
    """The model named is neither built in nor on this machine (omnirt never downloads weights)."""


# ---- what the engine tells about itself ----------------------------------------------------------------


class StageLimit(msgspec.Struct, frozen=True):
    max_num_seqs: int
    max_waiting: int

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_waiting


class FrontEndLimits(msgspec.Struct, frozen=True):
    """The deploy profile's `front_end` section: when an API process refuses new Realtime sessions for its own
    load (None: that check is off)."""

    max_loop_lag_ms: float | None = None
    max_vad_backlog_ms: float | None = None


def settled_windows(num_samples: int, window_samples: int, lookahead_samples: int) -> int:
    """Whole encoder windows of `window_samples` in an audio of `num_samples`, counting only those followed by the
    `lookahead_samples` their last features read (0 where the model has no windows)."""
    return max(0, (num_samples - lookahead_samples) // window_samples) if window_samples else 0


class EngineInfo(msgspec.Struct, frozen=True, tag=True):
    """Static facts, fixed at start-up."""

    model: str
    voices: tuple[str, ...]
    default_voice: str
    system_prompt: str | None
    has_audio_output: bool
    input_sample_rate: int
    output_sample_rate: int
    stage_limits: dict[str, StageLimit]  # admission per stage, in graph order
    retry_after_s: float
    max_output_buffer_bytes: int  # unread output a request may hold before it is aborted
    kind: str = "omnirt"  # "omnirt" | "reference"
    platform: str = "cpu"  # where the engine runs (cuda, rocm, npu, xpu, cpu)
    voice_aliases: dict[str, str] = msgspec.field(default_factory=dict)  # other names -> voices (the profile's)
    model_aliases: tuple[str, ...] = ()  # other names of the model: names or fnmatch patterns (the profile's)
    front_end: FrontEndLimits = msgspec.field(default_factory=FrontEndLimits)  # the API processes' load limits
    # input samples per window of the audio encoder (0: no speculative prefill), and the samples after a
    # window that its features read: see `num_settled_windows`
    audio_window_samples: int = 0
    audio_lookahead_samples: int = 0

    def num_settled_windows(self, num_samples: int) -> int:
        """Windows of an audio of `num_samples` samples that a `prefill_only` request prefills: those whose
        tokens no later audio changes (but for a louder later part, which makes the engine prefill them anew)."""
        return settled_windows(num_samples, self.audio_window_samples, self.audio_lookahead_samples)

    @property
    def voice_names(self) -> tuple[str, ...]:
        """Every name a request may give as its voice: the model's voices, then their aliases."""
        return self.voices + tuple(a for a in self.voice_aliases if a not in self.voices)

    def stages_for(self, wants_audio: bool) -> tuple[str, ...]:
        stages = tuple(self.stage_limits)
        return stages if wants_audio else stages[:1]


# upper bounds (seconds) of StageStats.first_output_counts' buckets; one more bucket holds the rest
FIRST_OUTPUT_BUCKETS_S = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class StageStats(msgspec.Struct, frozen=True):
    name: str
    free_slots: int
    slots: int
    admission_waiting: int = 0
    running: int | None = None  # None: the stage runs in replicas, which report on /health
    waiting: int | None = None
    batch_size_counts: list[int] | None = None  # steps per batch size
    busy_s: float | None = None  # seconds inside steps
    device_wait_s: float | None = None  # the part of busy_s spent waiting for the device
    prefill_tokens: int | None = None  # prompt tokens computed by prefill steps
    cached_tokens: int | None = None  # prompt tokens reused from resident slots instead
    resident_slots: int | None = None  # slots holding an ended request's KV for reuse (counted in free_slots)
    resident_bytes: int | None = None  # memory those keep beyond the KV cache (e.g. the Thinker's rows)
    offloaded: int | None = None  # resident slots' prefixes given up to the host tier and kept there
    offloaded_bytes: int | None = None  # host memory those take
    restored_tokens: int | None = None  # prompt tokens copied back from there (counted in cached_tokens)
    placements: dict[str, int] | None = None  # requests by how they got a slot: fresh, taken_over, copied, restored
    given_up: int | None = None  # resident slots given up for another request (their prefix kept only with a tier)
    first_steps: int | None = None  # requests that took their first step (omnirt/pipeline/priority.py's WaitCounts)
    first_wait_steps: int | None = None  # steps they waited, runnable, before it (summed)
    max_wait_steps: int | None = None  # the most steps a runnable request waited between two of its steps
    deferred_rows: int | None = None  # rows steps had no room for
    first_output_counts: list[int] | None = None  # requests per bucket of submission -> first output here
    first_output_s: float | None = None  # those seconds, summed (omnirt/pipeline/timeline.py)
    decode_steps: int | None = None  # the steps that were decode steps (the others: prefill chunks)
    decode_busy_s: float | None = None  # the part of busy_s in them


class EngineStats(msgspec.Struct, frozen=True, tag=True):
    """A snapshot for /metrics and /health."""

    active_requests: int = 0
    stages: list[StageStats] = msgspec.field(default_factory=list)
    admission_refused: int = 0
    replicas: dict[str, list[dict[str, Any]]] = msgspec.field(default_factory=dict)
    allocator: dict[str, int] = msgspec.field(default_factory=dict)  # Platform.allocator_counters of the engine


class EngineHealth(msgspec.Struct, frozen=True):
    is_alive: bool
    reason: str | None = None  # why not



# ---- how to start an engine ----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class EngineOptions:
    """How to build the engine: the command line's engine flags, as plain values (they cross to the core).
    Everything else is a deploy profile key, which `settings` (`--set KEY=VALUE`) may override."""

    model: str = "tiny"
    deploy_config: str | None = None
    load_format: str | None = None
    dtype: str | None = None
    stage_overrides: dict[str, dict] = field(default_factory=dict)  # stage id or name -> profile keys
    settings: tuple[str, ...] = ()  # "KEY=VALUE" profile keys (`omnirt/pipeline/profile.py`: Override), applied last
    enforce_eager: bool = False
    platform: str | None = None
    distributed: str | None = None
    threads: int | None = None
    max_output_buffer_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # the profile's top-level one, overridden
    step_log: str | None = None  # a file each stage appends a line per step to
    process: Literal["auto", "core", "inproc"] = "auto"
    log_level: str = "info"
    log_format: str = "text"
