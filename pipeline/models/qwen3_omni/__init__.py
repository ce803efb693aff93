"""Qwen3-Omni (transformers' `Qwen3OmniMoeForConditionalGeneration`): Thinker -> Talker -> Code2Wav.

This module declares the family's stages, the one place their names are written (the profile checks, the
command line and the graph read them here), without importing torch: the API process checks deploy profiles
against them before anything loads. `load()` builds the stage models (`models.py`) and the graph (`graph.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import EngineConfig, ModelSpec, StageSpec

if TYPE_CHECKING:
    from pipeline.models.qwen3_omni.models import OmniModels
    from pipeline.platform import Platform

STAGES = (
    StageSpec("thinker"),  # multimodal prompt -> text tokens, and the rows the Talker reads
    StageSpec("talker"),  # -> codec frames (16 codes each; the code predictor fills codebooks 1..15)
    StageSpec("code2wav", autoregressive=False),  # codec frames -> 24 kHz PCM, in chunks with left context
)
THINKER, TALKER, CODE2WAV = (s.name for s in STAGES)


def model_spec(model: str) -> ModelSpec:
    """The built-in tiny model runs with deploy/tiny.yaml, every other with the full-size profile."""
    return ModelSpec(STAGES, "tiny.yaml" if model == "tiny" else "qwen3_omni_moe.yaml")


def load(cfg: EngineConfig, platform: Platform, stages: tuple[str, ...]) -> OmniModels:
    """The models of `stages` (the others are not loaded), the prompt encoder and the stage graph."""
    from pipeline.models.qwen3_omni.models import load_models  # deferred: keeps torch out of the API process

    return load_models(cfg, platform, stages)
