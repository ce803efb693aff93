"""Deploy profiles read as `omnirt serve` reads them, for the tests: Qwen3-Omni's stages, and command-line
overrides given as mappings (top-level keys as their flags, stage keys as `--stage-overrides`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnirt.pipeline import profile
from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.models import model_spec
from omnirt.pipeline.models.qwen3_omni.stages import STAGES
from omnirt.pipeline.profile import Override
from omnirt.pipeline.types import EngineOptions


def overrides(top: dict[str, Any] | None = None, stages: dict[str, dict] | None = None) -> list[Override]:
    out = [Override(f"stages.{sid}.{k}", v, "--stage-overrides") for sid, keys in (stages or {}).items()
           for k, v in keys.items()]
    return out + [Override(k, v, f"--{k.replace('_', '-')}") for k, v in (top or {}).items() if v is not None]


def load_profile(path: str | Path, platform: str, overrides_: dict[str, Any] | None = None,
                 stage_overrides: dict[str, dict] | None = None) -> EngineConfig:
    return profile.load_profile(path, platform, STAGES, overrides(overrides_, stage_overrides))


def build_config(raw: dict[str, Any], platform: str, overrides_: dict[str, Any] | None = None,
                 stage_overrides: dict[str, dict] | None = None) -> EngineConfig:
    return profile.build_config(raw, platform, STAGES, overrides(overrides_, stage_overrides))


def engine_config(opts: EngineOptions, platform: str) -> EngineConfig:
    return profile.engine_config(opts, platform, model_spec(opts.model))
