"""Deploy profiles: YAML, its platform entry and the command line -> a frozen `EngineConfig`.

Precedence, highest first: the command line (`--set KEY=VALUE`, then the named flags, then
`--stage-overrides`) > the profile's `platforms.<detected>` entry > the profile > built-in defaults. A bad
value raises `ProfileError` naming the key, where it came from (the file and line, or the flag) and what is
accepted. Nothing here imports torch: `omnirt serve` checks a profile for every platform (`check_options`)
before the model loads.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omnirt.pipeline.config import (
    AR_ONLY_KEYS,
    ConnectorConfig,
    EngineConfig,
    FrontEndConfig,
    ModelSpec,
    ProfileError,
    StageConfig,
    StageSpec,
    check_key,
    is_number,
)
from omnirt.pipeline.types import PLATFORMS, EngineOptions
from omnirt.pipeline.yaml_lines import YamlError, read_yaml

DEPLOY_DIR = Path(str(resources.files("omnirt") / "deploy"))  # the shipped profiles: package data
SET_EXAMPLE = "--set async_chunk=false"


@dataclass(slots=True, frozen=True)
class Override:
    """A value the command line sets over the profile. `key` is a path of profile keys, a stage named by its
    id, its name or `*` (every stage the key applies to): `dtype`, `connector.async_chunk`,
    `stages.1.max_num_seqs`, `stages.talker.default_sampling_params.max_tokens`, `stages.*.prefix_caching`."""

    key: str
    value: Any
    source: str  # the flag that set it, named in errors


# ---- from the command line's options -----------------------------------------------------------------


def profile_path(opts: EngineOptions, spec: ModelSpec) -> Path:
    """The profile `--deploy-config` names, else the model's own."""
    return shipped_or_file(opts.deploy_config) if opts.deploy_config else DEPLOY_DIR / spec.default_profile


def shipped_profiles() -> list[str]:
    """The names of the profiles that ship with omnirt (`--deploy-config NAME`)."""
    return sorted(p.stem for p in DEPLOY_DIR.glob("*.yaml"))


def shipped_or_file(given: str) -> Path:
    """A file that exists, else the shipped profile of that name: `qwen3_omni_moe_1gpu`, `tiny.yaml`, or
    `deploy/tiny.yaml` as a checkout spelled it, so that an installed wheel finds what a checkout finds."""
    path = Path(given)
    shipped = DEPLOY_DIR / f"{path.stem}.yaml"
    if not path.exists() and str(path.parent) in (".", "deploy") and shipped.exists():
        return shipped
    return path


def engine_config(opts: EngineOptions, platform: str, spec: ModelSpec) -> EngineConfig:
    """The engine's config on `platform`: the profile, its platform entry, then the command line."""
    for stage in opts.stage_overrides:
        try:
            _selected(str(stage), spec.stages, f"stages.{stage}")
        except ProfileError as exc:
            raise ProfileError(f"{stage!r} is not a stage: {_stage_range(spec.stages)} or *",
                               source="--stage-overrides") from exc
    return load_profile(profile_path(opts, spec), platform, spec.stages, command_line(opts))


def check_options(opts: EngineOptions, spec: ModelSpec) -> None:
    """Raise ProfileError if the engine would refuse these options on `--platform`, or on any platform
    when it is left to detection (which needs torch)."""
    for platform in (opts.platform,) if opts.platform else PLATFORMS:
        engine_config(opts, platform, spec)


def command_line(opts: EngineOptions) -> list[Override]:
    """The engine's flags as overrides, in the order they apply (a later one wins): `--stage-overrides`,
    the named flags, `--set`."""
    out = [Override(f"stages.{stage}.{k}", v, "--stage-overrides")
           for stage, keys in opts.stage_overrides.items() for k, v in keys.items()]
    named = {"model": opts.model, "load_format": opts.load_format, "dtype": opts.dtype,
             "distributed": opts.distributed, "max_output_buffer_bytes": opts.max_output_buffer_bytes,
             "gpu_memory_utilization": opts.gpu_memory_utilization, "step_log": opts.step_log}
    out += [Override(k, v, f"--{k.replace('_', '-')}") for k, v in named.items() if v is not None]
    if opts.enforce_eager:
        out += [Override(k, v, "--enforce-eager") for k, v in
                (("compile", "off"), ("stages.*.enforce_eager", True), ("stages.*.compile", "off"))]
    return out + [parse_setting(text) for text in opts.settings]


def parse_setting(text: str) -> Override:
    """`--set KEY=VALUE`, the value read as YAML reads one (`false`, `8`, `0.5`, `off`, `{max_tokens: 8}`)."""
    key, sep, value = text.partition("=")
    source = f"--set {text}"
    if not sep or not key.strip() or " " in key.strip():
        raise ProfileError(f"must be KEY=VALUE, e.g. {SET_EXAMPLE}", source=source)
    try:
        return Override(key.strip(), yaml.safe_load(value), source)
    except yaml.YAMLError as exc:
        raise ProfileError(f"its value is not valid YAML ({exc})", source=source) from None


# ---- reading and merging ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Origin:
    """Where the values came from, to name it in errors: the profile's file and its keys' lines, and the
    keys the command line set (`--dtype`, `--stage-overrides`, `--set`)."""

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


def load_profile(path: str | Path, platform: str, stages: tuple[StageSpec, ...],
                 overrides: list[Override] | tuple[Override, ...] = ()) -> EngineConfig:
    """Read a profile for a model with `stages`, merge its `platforms.<platform>` entry, then `overrides`."""
    try:
        raw, lines = read_yaml(Path(path))
    except YamlError as exc:
        shipped = "" if Path(path).exists() else f" (the shipped profiles, by name: {', '.join(shipped_profiles())})"
        raise ProfileError(exc.problem + shipped, source=f"deploy profile {path}{exc.where}") from exc
    if not isinstance(raw, dict):
        raise ProfileError("the top level must be a mapping of keys", source=f"deploy profile {path}")
    return build_config(raw, platform, stages, overrides, Origin(str(path), lines))


def build_config(raw: dict[str, Any], platform: str, stages: tuple[StageSpec, ...],
                 overrides: list[Override] | tuple[Override, ...] = (), origin: Origin = Origin()) -> EngineConfig:
    flags = {"platform": "--platform"}
    for ov in overrides:
        flags |= {key: ov.source for key in (ov.key, *_expanded_keys(ov, stages))}
    origin = dataclasses.replace(origin, flags=flags)
    try:
        return _merged(copy.deepcopy(raw), platform, stages, overrides)
    except ProfileError as exc:
        raise exc.at(origin.of(exc.key, platform)) from None


def _merged(raw: dict[str, Any], platform: str, specs: tuple[StageSpec, ...],
            overrides: list[Override] | tuple[Override, ...]) -> EngineConfig:
    platforms = raw.pop("platforms", None) or {}
    check_key(isinstance(platforms, dict), "platforms", "must be a mapping of platform name to overrides")
    for name in platforms:
        check_key(name in PLATFORMS, f"platforms.{name}", f"is not a platform ({', '.join(PLATFORMS)})")
    stages = _stages_by_id(raw.pop("stages", []), "stages", specs)
    entry = platforms.get(platform) or {}
    check_key(isinstance(entry, dict), f"platforms.{platform}", "must be a mapping of keys to override")
    for sid, over in _stages_by_id(entry.pop("stages", []), f"platforms.{platform}.stages", specs).items():
        _merge(stages.setdefault(sid, {"stage_id": sid}), over)
    raw = {**raw, **entry}
    for ov in overrides:
        _apply(raw, stages, specs, ov)
    raw["platform"] = platform
    return _build(raw, stages, specs)


def _stage_range(specs: tuple[StageSpec, ...]) -> str:
    return f"0..{len(specs) - 1} ({', '.join(s.name for s in specs)})"


def _stages_by_id(items: Any, key: str, specs: tuple[StageSpec, ...]) -> dict[int, dict[str, Any]]:
    check_key(isinstance(items, list), key, "must be a list of stage entries")
    out = {}
    for i, item in enumerate(items):
        check_key(isinstance(item, dict) and "stage_id" in item, f"{key}[{i}]", "must be a mapping with stage_id")
        check_key(type(item["stage_id"]) is int, f"{key}[{i}].stage_id", f"must be {_stage_range(specs)}")
        out[item["stage_id"]] = dict(item)
    return out


def _merge(entry: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        _put(entry, k, v)


def _put(node: dict[str, Any], key: str, value: Any) -> None:
    """Set `key`; a mapping set over a mapping keeps the siblings it does not name (default_sampling_params)."""
    if isinstance(value, dict) and isinstance(node.get(key), dict):
        node[key] = {**node[key], **value}
    else:
        node[key] = value


def _selected(selector: str, specs: tuple[StageSpec, ...], key: str) -> list[int]:
    """The stage ids a key's stage part names: an id, a name, or `*` for every stage."""
    names = [s.name for s in specs]
    if selector == "*":
        return list(range(len(specs)))
    if selector in names:
        return [names.index(selector)]
    check_key(selector.isdigit() and int(selector) < len(specs), key,
              f"names no stage: {selector!r} is not {_stage_range(specs)} or *")
    return [int(selector)]


def _expanded_keys(ov: Override, specs: tuple[StageSpec, ...]) -> list[str]:
    """The keys, as profile errors spell them, that a stage override sets (`stages[1].max_num_seqs`)."""
    parts = ov.key.split(".")
    if parts[0] != "stages" or len(parts) < 3:
        return []
    try:
        return [f"stages[{sid}].{'.'.join(parts[2:])}" for sid in _selected(parts[1], specs, ov.key)]
    except ProfileError:
        return []


def _apply(raw: dict[str, Any], stages: dict[int, dict[str, Any]], specs: tuple[StageSpec, ...],
           ov: Override) -> None:
    parts = ov.key.split(".")
    if parts[0] != "stages":
        _set_path(raw, parts, ov.value, ov.key)
        return
    check_key(len(parts) >= 3, ov.key, "must name a stage and its key: stages.<id, name or *>.<key>")
    for sid in _selected(parts[1], specs, ov.key):
        if parts[1] == "*" and parts[2] in AR_ONLY_KEYS and not specs[sid].autoregressive:
            continue  # every stage the key applies to
        _set_path(stages.setdefault(sid, {"stage_id": sid}), parts[2:], ov.value, ov.key)


def _set_path(node: dict[str, Any], parts: list[str], value: Any, key: str) -> None:
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        check_key(isinstance(node, dict), key, f"cannot be set: {part!r} is not a mapping")
    _put(node, parts[-1], value)


def _build(raw: dict[str, Any], stages: dict[int, dict[str, Any]], specs: tuple[StageSpec, ...]) -> EngineConfig:
    connector = raw.pop("connector", {}) or {}
    check_key(isinstance(connector, dict), "connector", "must be a mapping of keys")
    front_end = raw.pop("front_end", {}) or {}
    check_key(isinstance(front_end, dict), "front_end", "must be a mapping of keys")
    if "async_chunk" in raw:
        connector["async_chunk"] = raw.pop("async_chunk")
    for entry in (raw, *stages.values()):
        if isinstance(entry.get("compile"), bool):  # YAML reads a bare on/off as a boolean
            entry["compile"] = "on" if entry["compile"] else "off"
    autoregressive = ", ".join(s.name for s in specs if s.autoregressive)
    for sid, entry in stages.items():
        check_key(0 <= sid < len(specs), f"stages[{sid}].stage_id", f"must be {_stage_range(specs)}")
        for k in AR_ONLY_KEYS if not specs[sid].autoregressive else ():
            check_key(k not in entry, f"stages[{sid}].{k}", f"is read by the autoregressive stages only "
                      f"({autoregressive}); {specs[sid].name} has no KV cache, prompt or sampling: remove it")
    stage_objs = tuple(_make(StageConfig, stages.get(i, {"stage_id": i}), f"stages[{i}].", spec=spec)
                       for i, spec in enumerate(specs))
    return _make(EngineConfig, {**raw, "stages": stage_objs,
                                "connector": _make(ConnectorConfig, connector, "connector."),
                                "front_end": _make(FrontEndConfig, front_end, "front_end.")}, "")


def _make(cls, values: dict[str, Any], prefix: str, **fixed: Any):
    """`cls(**values, **fixed)`, once every key of `values` is one of its fields (not one of `fixed`, which the
    model sets) and every value of the field's type."""
    hints = {k: v for k, v in typing.get_type_hints(cls).items() if k not in fixed}
    for k, v in values.items():
        check_key(k in hints, f"{prefix}{k}", f"is not a known key ({', '.join(sorted(hints))})")
        check_key(_has_type(v, hints[k]), f"{prefix}{k}", f"must be {_type_name(hints[k])}, got {v!r}")
    return cls(**values, **fixed)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
               type(None): "null"}


def _has_type(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_has_type(value, h) for h in typing.get_args(hint))
    if hint is float:
        return is_number(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, typing.get_origin(hint) or hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return _TYPE_NAMES.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))
