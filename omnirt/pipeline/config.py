"""The engine's config: frozen, checked dataclasses, one per component, built from a deploy profile
(`omnirt/pipeline/profile.py` reads and merges it). Each check names the key as the profile spells it
(`stages[1].max_num_seqs`), so that a `ProfileError` can say where the bad value came from. The stages are
the model family's (`StageSpec`, declared once in the family's package); nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnirt.pipeline.types import (
    ATTENTION,
    COMPILE,
    CONV_BACKENDS,
    DISTRIBUTED,
    DTYPES,
    MOE_BACKENDS,
    PLATFORMS,
    QUANTIZATIONS,
)

ENGINES = ("omnirt", "reference")  # reference: transformers' own generate(), one request at a time (the baseline)
AR_ONLY_KEYS = ("max_num_batched_tokens", "max_model_len", "prefix_caching", "kv_offload_gib",
                "default_sampling_params")
PACINGS = ("fixed", "adaptive")
ROUTING = ("least_loaded", "round_robin")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_tokens", "min_tokens", "seed")
# OpenAI's realtime and audio model families (fnmatch patterns): code written for them runs unchanged
OPENAI_MODEL_ALIASES = ("gpt-realtime*", "gpt-4o*-realtime*", "gpt-audio*", "gpt-4o*-audio*")


@dataclass(slots=True, frozen=True)
class StageSpec:
    """A stage as its model family declares it: the name profiles and flags may call it by, and whether it is
    autoregressive (a KV cache, a prompt and sampling: the keys in AR_ONLY_KEYS are its alone)."""

    name: str
    autoregressive: bool = True


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """What a deploy profile is read against: the model family's stages, in graph order, and the profile (a file
    in omnirt/deploy/) a model of it runs with when none is named."""

    stages: tuple[StageSpec, ...]
    default_profile: str


class ProfileError(ValueError):
    """A profile or flag value the engine cannot use; `key` names it as the profile spells it."""

    def __init__(self, message: str, key: str | None = None, source: str | None = None):
        super().__init__(f"{source or 'deploy profile'}: {message}")
        self.message, self.key = message, key

    def at(self, source: str | None) -> ProfileError:
        return ProfileError(self.message, self.key, source)


@dataclass(slots=True, frozen=True)
class StageConfig:
    stage_id: int
    devices: str | int = "0"  # "0" or "1,2" (YAML reads a bare 0 as a number)
    num_replicas: int = 1
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting: int = 64  # requests admitted beyond max_num_seqs to wait for a slot; more get refused
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    routing: str = "least_loaded"  # how a replica pool places new requests: least_loaded | round_robin
    own_process: bool = False  # a worker process even as one replica on the engine's device
    device_ipc: bool = True  # device tensors to/from its workers through shared device memory where the platform can
    ray_resources: dict[str, float] = field(default_factory=dict)  # per replica actor, e.g. {num_gpus: 1}
    prefix_caching: bool = True  # an ended request's KV stays resident for a prompt that starts the same way
    kv_offload_gib: float = 0.0  # host memory for resident prefixes given up for a slot (0: dropped; host_tier.py)
    compile: str | None = None  # this stage's torch.compile (auto | on | off); None: the engine's `compile`
    compiled_prefill: bool = True  # where the decode layers are compiled, prefill chunks run them too (warmed)
    prefill_graph_tokens: int = 2048  # graphs on: a prefill batch of at most this many padded tokens replays one
    async_scheduling: bool = False  # issue step n+1 before step n's tokens reach the host (stage/loop.py)
    spec: StageSpec = StageSpec("stage")  # what the model's graph says this stage is (not a profile key)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device_ids(self) -> list[int]:
        return [int(d) for d in str(self.devices).split(",")]

    def replica_device(self, replica: int) -> int:
        """Replicas take the listed devices in turn (3 replicas on "1,2": 1, 2, 1)."""
        return self.device_ids[replica % len(self.device_ids)]

    @property
    def needs_workers(self) -> bool:
        """Replicated, placed off the engine's device (0), or asked to: the stage runs in worker processes
        or actors."""
        return self.num_replicas > 1 or self.device_ids != [0] or self.own_process

    def __post_init__(self):
        check_key(self.num_replicas >= 1, f"stages[{self.stage_id}].num_replicas", "must be >= 1")
        check_key(self.max_num_seqs >= 1, f"stages[{self.stage_id}].max_num_seqs", "must be >= 1")
        check_key(self.max_num_batched_tokens >= 1, f"stages[{self.stage_id}].max_num_batched_tokens", "must be >= 1")
        check_key(self.prefill_graph_tokens >= 0, f"stages[{self.stage_id}].prefill_graph_tokens", "must be >= 0")
        check_key(self.max_waiting >= 0, f"stages[{self.stage_id}].max_waiting", "must be >= 0")
        check_key(self.max_model_len >= 16, f"stages[{self.stage_id}].max_model_len", "must be >= 16")
        check_key(self.kv_offload_gib >= 0, f"stages[{self.stage_id}].kv_offload_gib", "must be >= 0")
        key = f"stages[{self.stage_id}]"
        _check_fraction(self.gpu_memory_utilization, f"{key}.gpu_memory_utilization")
        devices = [d.strip() for d in str(self.devices).split(",")]
        check_key(all(d.isdigit() for d in devices) and len(set(map(int, devices))) == len(devices), f"{key}.devices",
               f"must be a comma-separated list of distinct device indices, got {self.devices!r}")
        check_key(len(devices) <= self.num_replicas, f"{key}.devices",
               f"lists {len(devices)} devices for num_replicas={self.num_replicas}; each replica takes one device "
               "(replicas share devices in turn when there are more replicas than devices)")
        check_key(self.routing in ROUTING, f"{key}.routing", f"must be one of {', '.join(ROUTING)}")
        check_key(self.compile is None or self.compile in COMPILE, f"{key}.compile",
               f"must be one of {', '.join(COMPILE)}")
        check_key(all(k in ("num_cpus", "num_gpus", "memory") and isinstance(v, int | float) and v >= 0
                   for k, v in self.ray_resources.items()), f"{key}.ray_resources",
               "must map num_cpus / num_gpus / memory to numbers >= 0")
        for name, value in self.default_sampling_params.items():
            where = f"{key}.default_sampling_params.{name}"
            check_key(name in SAMPLING_KEYS, where, f"is not a sampling parameter ({', '.join(SAMPLING_KEYS)})")
            check_key(is_number(value) or (name == "seed" and value is None), where, f"must be a number, got {value!r}")


@dataclass(slots=True, frozen=True)
class ConnectorConfig:
    initial_codec_chunk_frames: int = 4
    codec_chunk_frames: int = 25
    codec_left_context_frames: int = 25
    codec_chunk_ramp: bool = False  # fixed pacing: chunks of initial * 2**k frames up to codec_chunk_frames
    codec_chunk_pacing: str = "fixed"  # fixed (the sizes above) | adaptive (to the Talker's pace): qwen3_omni/pacing.py
    codec_chunk_margin_ms: float = 160.0  # adaptive: audio a listener keeps queued when a chunk is decided
    async_chunk: bool = True

    def __post_init__(self):
        check_key(self.initial_codec_chunk_frames >= 1, "connector.initial_codec_chunk_frames", "must be >= 1")
        check_key(self.codec_chunk_frames >= 1, "connector.codec_chunk_frames", "must be >= 1")
        check_key(self.codec_left_context_frames >= 1, "connector.codec_left_context_frames",
               "must be >= 1 (a chunk re-emits the previous chunk's withheld tail from its context)")
        check_key(self.codec_chunk_pacing in PACINGS, "connector.codec_chunk_pacing",
               f"must be one of {', '.join(PACINGS)}")
        check_key(self.codec_chunk_margin_ms >= 0, "connector.codec_chunk_margin_ms", "must be >= 0")


@dataclass(slots=True, frozen=True)
class FrontEndConfig:
    """When an API process refuses new Realtime sessions for its own load (`omnirt/app/ops/front_end_load.py`): past
    either limit; None turns that check off. Read by the API processes, not the engine."""

    max_loop_lag_ms: float | None = 100.0  # how late the event loop runs its callbacks, smoothed
    max_vad_backlog_ms: float | None = 200.0  # how long the oldest audio waiting for the VAD has waited

    def __post_init__(self):
        for key in ("max_loop_lag_ms", "max_vad_backlog_ms"):
            value = getattr(self, key)
            check_key(value is None or value > 0, f"front_end.{key}", f"must be > 0 or null (off), got {value}")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = "tiny"
    load_format: str = "auto"  # "auto" (weights from the checkpoint) | "dummy" (random, real architecture)
    moe_backend: str = "auto"  # "auto" (grouped_mm where graphs run, else eager) | one of MOE_BACKENDS
    # "fp8": the MoE experts' weights in block-scaled FP8 (omnirt/pipeline/kernels/fp8.py); "auto": FP8 where the
    # weights would take more than half the device (models/qwen3_omni/models.py); an FP8 checkpoint is FP8 anyway
    quantization: str = "none"
    attention: str = "auto"  # "auto" (slots where graphs run and Triton imports, else dense) | "slots" | "dense"
    compile: str = "auto"  # torch.compile the decode steps: "auto" (where a stage's graphs run) | "on" | "off"
    conv_backend: str = "native"  # Code2Wav's convolutions: one of CONV_BACKENDS (the same function re-expressed)
    dtype: str = "float32"
    platform: str = "cpu"
    distributed: str = "none"  # where out-of-process stage replicas run: "none" (local processes) | "ray" (actors)
    async_output: bool = True  # stage threads never wait for the consumer of their outputs
    first_packet_priority: bool = True  # steps serve requests still owed their first packet first (priority.py)
    max_wait_steps: int = 4  # with it: a runnable request left out of this many steps in a row goes first
    default_voice: str = "ethan"
    voice_aliases: dict[str, str] = field(default_factory=dict)  # other names for the model's voices (OpenAI's)
    # other names for the served model: names or fnmatch patterns (OpenAI's families unless the profile says)
    model_aliases: list[str] = field(default_factory=lambda: list(OPENAI_MODEL_ALIASES))
    system_prompt: str = "You are a helpful voice assistant."
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    front_end: FrontEndConfig = field(default_factory=FrontEndConfig)  # the API processes' load limits
    stages: tuple[StageConfig, ...] = ()
    max_output_buffer_bytes: int = 8 * 2**20  # events a request may hold unread before it is aborted
    retry_after_s: float = 1.0  # what a refused request is told when the engine is full
    gpu_memory_utilization: float | None = None  # the device share of stages without their own (stage/memory_plan.py)
    step_log: str | None = None  # a file every stage appends one line per step to (`Stage`)
    engine: str = "omnirt"  # one of ENGINES: "reference" serves transformers' generate() (the baseline)

    def __post_init__(self):
        check_key(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        check_key(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        check_key(self.moe_backend in MOE_BACKENDS, "moe_backend", f"must be one of {', '.join(MOE_BACKENDS)}")
        check_key(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {', '.join(QUANTIZATIONS)}")
        check_key(self.quantization != "fp8" or self.moe_backend in ("auto", "triton", "eager"), "quantization",
                  "fp8 experts run on the fused Triton kernels (moe_backend: auto or triton) or dequantised (eager), "
                  f"not {self.moe_backend}")
        check_key(self.attention in ATTENTION, "attention", f"must be one of {', '.join(ATTENTION)}")
        check_key(self.compile in COMPILE, "compile", f"must be one of {', '.join(COMPILE)}")
        check_key(self.conv_backend in CONV_BACKENDS, "conv_backend", f"must be one of {', '.join(CONV_BACKENDS)}")
        check_key(self.platform in PLATFORMS, "platform", f"must be one of {', '.join(PLATFORMS)}")
        check_key(self.distributed in DISTRIBUTED, "distributed", f"must be one of {', '.join(DISTRIBUTED)}")
        check_key(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}")
        check_key(self.max_output_buffer_bytes >= 4096, "max_output_buffer_bytes", "must be >= 4096")
        check_key(self.max_wait_steps >= 1, "max_wait_steps", "must be >= 1")
        _check_fraction(self.gpu_memory_utilization, "gpu_memory_utilization")
        for alias, voice in self.voice_aliases.items():
            check_key(isinstance(alias, str) and isinstance(voice, str), f"voice_aliases.{alias}",
                   "must map a name to one of the model's voices (a string)")
        object.__setattr__(self, "voice_aliases", {a.lower(): v.lower() for a, v in self.voice_aliases.items()})
        for i, alias in enumerate(self.model_aliases):
            check_key(isinstance(alias, str) and alias.strip() != "", f"model_aliases[{i}]",
                      "must be a model name or an fnmatch pattern (e.g. 'gpt-realtime*'), a non-empty string")
        object.__setattr__(self, "model_aliases", [a.lower() for a in self.model_aliases])
        check_key([s.stage_id for s in self.stages] == list(range(len(self.stages))), "stages",
               "must list stage_id 0, 1, ... once each, in order")
        if self.distributed == "none":  # with Ray the device indices only name replicas
            self._check_device_shares()

    def _check_device_shares(self) -> None:
        """The stages' own fractions of one device add up to at most the global one (or the whole device)."""
        cap = self.gpu_memory_utilization or 1.0
        used: dict[int, float] = {}
        for s in self.stages:
            if s.gpu_memory_utilization is None:
                continue
            for device in {s.replica_device(r) for r in range(s.num_replicas)}:
                used[device] = used.get(device, 0.0) + s.gpu_memory_utilization
                check_key(used[device] <= cap + 1e-9, f"stages[{s.stage_id}].gpu_memory_utilization",
                       f"brings the stages' shares of device {device} to {used[device]:.3g}, over "
                       + (f"gpu_memory_utilization {cap}" if self.gpu_memory_utilization else "the whole device (1.0)"))

    def stage(self, name: str) -> StageConfig:
        return next(s for s in self.stages if s.name == name)

    def compiles(self, name: str, graphs: bool) -> bool:
        """Whether stage `name` compiles its steps, where the platform `graphs` or not (the stage's own
        setting over the engine's)."""
        stage = self.stage(name)
        mode = stage.compile or self.compile
        if mode == "auto":
            return graphs and not stage.enforce_eager
        return mode == "on"

    def check_voices(self, voices: list[str]) -> None:
        """Every alias names a voice of the loaded model (known once it is loaded; a model without speech
        has none to name)."""
        for alias, voice in self.voice_aliases.items():
            check_key(not voices or voice in voices, f"voice_aliases.{alias}",
                   f"names {voice!r}, not a voice of this model ({', '.join(voices)})")


def check_key(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ProfileError(f"{key} {why}", key)


def _check_fraction(value: float | None, key: str) -> None:
    check_key(value is None or 0 < value <= 1, key, f"must be a fraction of the device's memory in (0, 1], got {value}")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
