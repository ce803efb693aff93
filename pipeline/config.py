"""Deploy profiles: YAML -> frozen engine config.

Precedence, highest first: CLI overrides (`--stage-overrides`, global flags) > the profile's
`platforms.<detected>` entry > the profile > built-in defaults. A bad profile raises
`ProfileError` naming the offending key, where it came from (the file and line, or the flag) and
the accepted values. Nothing here imports torch: `omnirt serve` checks a profile for every platform
(`check_options`) before the model loads.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.types import (
    ATTENTION,
    COMPILE,
    CONV_BACKENDS,
    DISTRIBUTED,
    DTYPES,
    MOE_BACKENDS,
    PLATFORMS,
    EngineOptions,
)
from pipeline.yaml_lines import YamlError, read_yaml

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy"
STAGE_NAMES = ("thinker", "talker", "code2wav")
AR_STAGES = STAGE_NAMES[:2]  # the autoregressive ones: KV caches, prompts, sampling
AR_ONLY_KEYS = ("max_num_batched_tokens", "max_model_len", "prefix_caching", "default_sampling_params")
PACINGS = ("fixed", "adaptive")
ROUTING = ("least_loaded", "round_robin")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "max_tokens", "min_tokens", "seed")


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
    compile: str | None = None  # this stage's torch.compile (auto | on | off); None: the engine's `compile`
    compiled_prefill: bool = True  # where the decode layers are compiled, prefill chunks run them too (warmed)
    prefill_graph_tokens: int = 2048  # graphs on: a prefill batch of at most this many padded tokens replays one
    async_scheduling: bool = False  # issue step n+1 before step n's tokens reach the host (stage.py); the talker

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage_id]

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
        _check(0 <= self.stage_id < len(STAGE_NAMES), "stage_id", f"must be 0..{len(STAGE_NAMES) - 1}")
        _check(self.num_replicas >= 1, f"stages[{self.stage_id}].num_replicas", "must be >= 1")
        _check(self.max_num_seqs >= 1, f"stages[{self.stage_id}].max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, f"stages[{self.stage_id}].max_num_batched_tokens", "must be >= 1")
        _check(self.prefill_graph_tokens >= 0, f"stages[{self.stage_id}].prefill_graph_tokens", "must be >= 0")
        _check(self.max_waiting >= 0, f"stages[{self.stage_id}].max_waiting", "must be >= 0")
        _check(self.max_model_len >= 16, f"stages[{self.stage_id}].max_model_len", "must be >= 16")
        key = f"stages[{self.stage_id}]"
        _check_fraction(self.gpu_memory_utilization, f"{key}.gpu_memory_utilization")
        devices = [d.strip() for d in str(self.devices).split(",")]
        _check(all(d.isdigit() for d in devices) and len(set(map(int, devices))) == len(devices), f"{key}.devices",
               f"must be a comma-separated list of distinct device indices, got {self.devices!r}")
        _check(len(devices) <= self.num_replicas, f"{key}.devices",
               f"lists {len(devices)} devices for num_replicas={self.num_replicas}; each replica takes one device "
               "(replicas share devices in turn when there are more replicas than devices)")
        _check(self.routing in ROUTING, f"{key}.routing", f"must be one of {', '.join(ROUTING)}")
        _check(self.compile is None or self.compile in COMPILE, f"{key}.compile",
               f"must be one of {', '.join(COMPILE)}")
        _check(all(k in ("num_cpus", "num_gpus", "memory") and isinstance(v, int | float) and v >= 0
                   for k, v in self.ray_resources.items()), f"{key}.ray_resources",
               "must map num_cpus / num_gpus / memory to numbers >= 0")
        for name, value in self.default_sampling_params.items():
            where = f"{key}.default_sampling_params.{name}"
            _check(name in SAMPLING_KEYS, where, f"is not a sampling parameter ({', '.join(SAMPLING_KEYS)})")
            _check(_is_number(value) or (name == "seed" and value is None), where, f"must be a number, got {value!r}")


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
        _check(self.initial_codec_chunk_frames >= 1, "connector.initial_codec_chunk_frames", "must be >= 1")
        _check(self.codec_chunk_frames >= 1, "connector.codec_chunk_frames", "must be >= 1")
        _check(self.codec_left_context_frames >= 1, "connector.codec_left_context_frames",
               "must be >= 1 (a chunk re-emits the previous chunk's withheld tail from its context)")
        _check(self.codec_chunk_pacing in PACINGS, "connector.codec_chunk_pacing",
               f"must be one of {', '.join(PACINGS)}")
        _check(self.codec_chunk_margin_ms >= 0, "connector.codec_chunk_margin_ms", "must be >= 0")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model: str = "tiny"
    load_format: str = "auto"  # "auto" (weights from the checkpoint) | "dummy" (random, real architecture)
    moe_backend: str = "auto"  # "auto" (grouped_mm where graphs run, else eager) | one of MOE_BACKENDS
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
    system_prompt: str = "You are a helpful voice assistant."
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    stages: tuple[StageConfig, ...] = ()
    max_output_buffer_bytes: int = 8 * 2**20  # events a request may hold unread before it is aborted
    retry_after_s: float = 1.0  # what a refused request is told when the engine is full
    gpu_memory_utilization: float | None = None  # the device share of stages without their own (stage/memory_plan.py)
    step_log: str | None = None  # a file every stage appends one line per step to (`Stage`)

    def __post_init__(self):
        _check(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        _check(self.moe_backend in MOE_BACKENDS, "moe_backend", f"must be one of {', '.join(MOE_BACKENDS)}")
        _check(self.attention in ATTENTION, "attention", f"must be one of {', '.join(ATTENTION)}")
        _check(self.compile in COMPILE, "compile", f"must be one of {', '.join(COMPILE)}")
        _check(self.conv_backend in CONV_BACKENDS, "conv_backend", f"must be one of {', '.join(CONV_BACKENDS)}")
        _check(self.platform in PLATFORMS, "platform", f"must be one of {', '.join(PLATFORMS)}")
        _check(self.distributed in DISTRIBUTED, "distributed", f"must be one of {', '.join(DISTRIBUTED)}")
        _check(self.max_output_buffer_bytes >= 4096, "max_output_buffer_bytes", "must be >= 4096")
        _check(self.max_wait_steps >= 1, "max_wait_steps", "must be >= 1")
        _check_fraction(self.gpu_memory_utilization, "gpu_memory_utilization")
        for alias, voice in self.voice_aliases.items():
            _check(isinstance(alias, str) and isinstance(voice, str), f"voice_aliases.{alias}",
                   "must map a name to one of the model's voices (a string)")
        object.__setattr__(self, "voice_aliases", {a.lower(): v.lower() for a, v in self.voice_aliases.items()})
        if not self.stages:
            object.__setattr__(self, "stages", tuple(StageConfig(i) for i in range(len(STAGE_NAMES))))
        _check([s.stage_id for s in self.stages] == list(range(len(STAGE_NAMES))), "stages",
               f"must list stage_id 0..{len(STAGE_NAMES) - 1} ({', '.join(STAGE_NAMES)}) once each, in order")
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
                _check(used[device] <= cap + 1e-9, f"stages[{s.stage_id}].gpu_memory_utilization",
                       f"brings the stages' shares of device {device} to {used[device]:.3g}, over "
                       + (f"gpu_memory_utilization {cap}" if self.gpu_memory_utilization else "the whole device (1.0)"))

    def stage(self, name: str) -> StageConfig:
        return self.stages[STAGE_NAMES.index(name)]

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
            _check(not voices or voice in voices, f"voice_aliases.{alias}",
                   f"names {voice!r}, not a voice of this model ({', '.join(voices)})")


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ProfileError(f"{key} {why}", key)


def _check_fraction(value: float | None, key: str) -> None:
    _check(value is None or 0 < value <= 1, key, f"must be a fraction of the device's memory in (0, 1], got {value}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---- from the command line's options -----------------------------------------------------------------


def profile_path(opts: EngineOptions) -> Path:
    """The profile `--deploy-config` names, else the model's own."""
    if opts.deploy_config:
        return Path(opts.deploy_config)
    return DEPLOY_DIR / ("tiny.yaml" if opts.model == "tiny" else "qwen3_omni_moe.yaml")


def engine_config(opts: EngineOptions, platform: str) -> EngineConfig:
    """The engine's config on `platform`: the profile, its platform entry, then the flags."""
    overrides = {"model": opts.model, "load_format": opts.load_format, "dtype": opts.dtype,
                 "async_output": _off(opts.async_output), "first_packet_priority": _off(opts.first_packet_priority),
                 "moe_backend": opts.moe_backend,
                 "attention": opts.attention, "compile": "off" if opts.enforce_eager else opts.compile,
                 "conv_backend": opts.conv_backend,
                 "distributed": opts.distributed, "max_output_buffer_bytes": opts.max_output_buffer_bytes,
                 "gpu_memory_utilization": opts.gpu_memory_utilization, "step_log": opts.step_log}
    cfg = load_profile(profile_path(opts), platform, overrides, stage_overrides(opts))
    if not opts.async_chunk:
        cfg = dataclasses.replace(cfg, connector=dataclasses.replace(cfg.connector, async_chunk=False))
    return cfg


def _off(switch: bool) -> bool | None:
    """An ablation flag's override: False when the flag turned the feature off, else the profile's value."""
    return None if switch else False


def stage_overrides(opts: EngineOptions) -> dict[str, dict]:
    """`--stage-overrides`, with the global ablations (`--enforce-eager`, `--no-prefix-caching`) set in
    every stage over them."""
    out = {str(k): dict(v) for k, v in opts.stage_overrides.items()}
    for sid, name in enumerate(STAGE_NAMES):
        forced = {"enforce_eager": True, "compile": "off"} if opts.enforce_eager else {}
        if not opts.prefix_caching and name in AR_STAGES:
            forced["prefix_caching"] = False
        if forced:
            out[str(sid)] = {**out.get(str(sid), {}), **forced}
    return out


def check_options(opts: EngineOptions) -> None:
    """Raise ProfileError if the engine would refuse these options on `--platform`, or on any platform
    when it is left to detection (which needs torch)."""
    for platform in (opts.platform,) if opts.platform else PLATFORMS:
        engine_config(opts, platform)


# ---- reading and merging ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Origin:
    """Where the values came from, to name it in errors: the profile's file and its keys' lines, and the
    keys the command line set (`--dtype`, `--stage-overrides`)."""

    path: str | None = None
    lines: dict[str, int] = field(default_factory=dict)  # "stages[1].max_num_seqs" -> line
    flags: dict[str, str] = field(default_factory=dict)  # the same keys -> the flag that set them

    def of(self, key: str | None, platform: str) -> str | None:
        """The flag, or the file and line, that gave `key` (or the nearest entry around it) its value."""
        while key:
            if key in self.flags:
                return self.flags[key]
            for k in (f"platforms.{platform}.{key}", key):
                if k in self.lines:
                    return f"deploy profile {self.path}, line {self.lines[k]}"
            key = key.rpartition("[" if key.endswith("]") else ".")[0]
        return f"deploy profile {self.path}" if self.path else None


def load_profile(path: str | Path, platform: str, overrides: dict[str, Any] | None = None,
                 stage_overrides: dict[str, dict[str, Any]] | None = None) -> EngineConfig:
    """Read a profile, merge its `platforms.<platform>` entry, then the CLI overrides."""
    try:
        raw, lines = read_yaml(Path(path))
    except YamlError as exc:
        raise ProfileError(exc.problem, source=f"deploy profile {path}{exc.where}") from exc
    if not isinstance(raw, dict):
        raise ProfileError("the top level must be a mapping of keys", source=f"deploy profile {path}")
    return build_config(raw, platform, overrides or {}, stage_overrides or {}, Origin(str(path), lines))


def build_config(raw: dict[str, Any], platform: str, overrides: dict[str, Any],
                 stage_overrides: dict[str, dict[str, Any]], origin: Origin = Origin()) -> EngineConfig:
    flags = {k: f"--{k.replace('_', '-')}" for k, v in overrides.items() if v is not None}
    flags |= {f"stages[{sid}].{k}": "--stage-overrides" for sid, entry in stage_overrides.items() for k in entry}
    origin = dataclasses.replace(origin, flags={**flags, "platform": "--platform"})
    try:
        return _merged(raw, platform, overrides, stage_overrides)
    except ProfileError as exc:
        raise exc.at(origin.of(exc.key, platform)) from None


def _merged(raw: dict[str, Any], platform: str, overrides: dict[str, Any],
            stage_overrides: dict[str, dict[str, Any]]) -> EngineConfig:
    raw = copy.deepcopy(raw)
    platforms = raw.pop("platforms", None) or {}
    _check(isinstance(platforms, dict), "platforms", "must be a mapping of platform name to overrides")
    for name in platforms:
        _check(name in PLATFORMS, f"platforms.{name}", f"is not a platform ({', '.join(PLATFORMS)})")
    stages = _stages_by_id(raw.pop("stages", []), "stages")
    entry = platforms.get(platform) or {}
    _check(isinstance(entry, dict), f"platforms.{platform}", "must be a mapping of keys to override")
    _merge_stages(stages, _stages_by_id(entry.pop("stages", []), f"platforms.{platform}.stages"))
    raw = {**raw, **entry, **{k: v for k, v in overrides.items() if v is not None}}
    _merge_stages(stages, {int(k): v for k, v in stage_overrides.items()})
    raw["platform"] = platform
    return _build(raw, stages)


def _stages_by_id(items: Any, key: str) -> dict[int, dict[str, Any]]:
    _check(isinstance(items, list), key, "must be a list of stage entries")
    out = {}
    for i, item in enumerate(items):
        _check(isinstance(item, dict) and "stage_id" in item, f"{key}[{i}]", "must be a mapping with stage_id")
        _check(type(item["stage_id"]) is int, f"{key}[{i}].stage_id",
               f"must be 0..{len(STAGE_NAMES) - 1} ({', '.join(STAGE_NAMES)})")
        out[item["stage_id"]] = dict(item)
    return out


def _merge_stages(base: dict[int, dict[str, Any]], over: dict[int, dict[str, Any]]) -> None:
    for sid, entry in over.items():
        cur = base.setdefault(sid, {"stage_id": sid})
        for k, v in entry.items():
            if isinstance(v, dict) and isinstance(cur.get(k), dict):
                cur[k] = {**cur[k], **v}  # e.g. default_sampling_params: keep siblings
            else:
                cur[k] = v


def _build(raw: dict[str, Any], stages: dict[int, dict[str, Any]]) -> EngineConfig:
    connector = raw.pop("connector", {}) or {}
    _check(isinstance(connector, dict), "connector", "must be a mapping of keys")
    if "async_chunk" in raw:
        connector["async_chunk"] = raw.pop("async_chunk")
    for entry in (raw, *stages.values()):
        if isinstance(entry.get("compile"), bool):  # YAML reads a bare on/off as a boolean
            entry["compile"] = "on" if entry["compile"] else "off"
    for sid, entry in stages.items():
        _check(0 <= sid < len(STAGE_NAMES), f"stages[{sid}].stage_id",
               f"must be 0..{len(STAGE_NAMES) - 1} ({', '.join(STAGE_NAMES)})")
        for k in AR_ONLY_KEYS if STAGE_NAMES[sid] not in AR_STAGES else ():
            _check(k not in entry, f"stages[{sid}].{k}", f"is read by the autoregressive stages only "
                   f"({', '.join(AR_STAGES)}); {STAGE_NAMES[sid]} has no KV cache, prompt or sampling: remove it")
    stage_objs = tuple(_make(StageConfig, stages.get(i, {"stage_id": i}), f"stages[{i}].")
                       for i in range(len(STAGE_NAMES)))
    return _make(EngineConfig, {**raw, "stages": stage_objs,
                                "connector": _make(ConnectorConfig, connector, "connector.")}, "")


def _make(cls, values: dict[str, Any], prefix: str):
    """`cls(**values)`, once every key is one of its fields and every value of the field's type."""
    hints = typing.get_type_hints(cls)
    for k, v in values.items():
        _check(k in hints, f"{prefix}{k}", f"is not a known key ({', '.join(sorted(hints))})")
        _check(_has_type(v, hints[k]), f"{prefix}{k}", f"must be {_type_name(hints[k])}, got {v!r}")
    return cls(**values)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
               type(None): "null"}


def _has_type(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_has_type(value, h) for h in typing.get_args(hint))
    if hint is float:
        return _is_number(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, typing.get_origin(hint) or hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return _TYPE_NAMES.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))
