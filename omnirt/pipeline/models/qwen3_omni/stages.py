"""Qwen3-Omni's stages, declared once: the profile checks, the command line and the graph (`graph.py`) read
their names here. Nothing here imports torch: the API process checks deploy profiles against them."""

from __future__ import annotations

from omnirt.pipeline.config import StageSpec

STAGES = (
    StageSpec("thinker"),  # multimodal prompt -> text tokens, and the rows the Talker reads
    StageSpec("talker"),  # -> codec frames (16 codes each; the code predictor fills codebooks 1..15)
    StageSpec("code2wav", autoregressive=False),  # codec frames -> 24 kHz PCM, in chunks with left context
)
THINKER, TALKER, CODE2WAV = (s.name for s in STAGES)
