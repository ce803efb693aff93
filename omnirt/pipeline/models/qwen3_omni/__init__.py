"""Qwen3-Omni (transformers' `Qwen3OmniMoeForConditionalGeneration`): Thinker -> Talker -> Code2Wav.

What the model registry asks of a family, without importing torch (the API process checks deploy profiles
against `model_spec`): its stages (`stages.py`) and default profile, and `load()`, which builds the stage
models, the prompt encoder and the stage graph (`models.py`, `graph.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnirt.pipeline.config import EngineConfig, ModelSpec
from omnirt.pipeline.models.qwen3_omni.stages import STAGES

if TYPE_CHECKING:  # type-only: the API process imports this package, and must not import torch
    from omnirt.pipeline.models.qwen3_omni.models import OmniModels
    from omnirt.pipeline.platform import Platform


def model_spec(model: str) -> ModelSpec:
    """The built-in tiny model runs with omnirt/deploy/tiny.yaml, every other with the full-size profile."""
    return ModelSpec(STAGES, "tiny.yaml" if model == "tiny" else "qwen3_omni_moe.yaml")


def load(cfg: EngineConfig, platform: Platform, stages: tuple[str, ...]) -> OmniModels:
    """The models of `stages` (the others are not loaded), the prompt encoder and the stage graph."""
    from omnirt.pipeline.models.qwen3_omni.models import load_models  # deferred: keeps torch out of the API process

    return load_models(cfg, platform, stages)
