"""The multimodal rope positions of a Qwen3-Omni prompt, for the Thinker and for the Talker (which takes the
Thinker prompt's user positions): transformers' `get_rope_index`, which runs an audio's placeholders one
position per frame and an image's over its grid's rows and columns."""

from __future__ import annotations

import torch


def rope_positions(model, ids: torch.Tensor, audio_lengths: torch.Tensor | None,
                   image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """`ids` [1, T] -> (positions [3, T], the offset of the positions after them). A text-only prompt has the
    plain positions 0..T-1 on all three axes, as `get_rope_index` gives them, without its host round trips."""
    if audio_lengths is None and image_grid_thw is None:
        return torch.arange(ids.shape[1], device=ids.device).expand(3, -1), 0
    pos, delta = model.get_rope_index(ids, _on(image_grid_thw, ids.device), None, torch.ones_like(ids), False,
                                      _on(audio_lengths, ids.device), None)
    return pos[:, 0].long(), int(delta.flatten()[0])


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
