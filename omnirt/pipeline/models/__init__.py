"""The model registry: which family serves a model, what the family declares of its stages, and loading it.

A family is a folder here whose package imports no torch and offers `model_spec(model)` (its stages and default
deploy profile, which the API process checks profiles against) and `load(cfg, platform, stages)` (the stage
models and the stage graph: a `LoadedModels`). Qwen3-Omni is the only family so far; another omni model is
another folder, an entry in `FAMILIES`, and its deploy profiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from omnirt.pipeline.config import EngineConfig, ModelSpec
from omnirt.pipeline.models import qwen3_omni

if TYPE_CHECKING:  # type-only: the API process imports the registry, and must not import torch
    from omnirt.pipeline.platform import Platform
    from omnirt.pipeline.stage.graph import LoadedModels


class ModelFamily(Protocol):
    def model_spec(self, model: str) -> ModelSpec: ...

    def load(self, cfg: EngineConfig, platform: Platform, stages: tuple[str, ...]) -> LoadedModels: ...


FAMILIES: dict[str, ModelFamily] = {"qwen3_omni": qwen3_omni}


def family(model: str) -> ModelFamily:
    """The family that serves `model`: Qwen3-Omni, the only one (with a second, the checkpoint's config.json
    `model_type` would choose)."""
    return FAMILIES["qwen3_omni"]


def model_spec(model: str) -> ModelSpec:
    return family(model).model_spec(model)


def load_models(cfg: EngineConfig, platform: Platform, stages: tuple[str, ...] | None = None) -> LoadedModels:
    """The models of `stages` (default: every stage of the profile); the others are not loaded."""
    return family(cfg.model).load(cfg, platform, stages or tuple(s.name for s in cfg.stages))
