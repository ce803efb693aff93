"""The multimodal rope positions of a Qwen3-Omni prompt, for the Thinker and for the Talker (which takes the
Thinker prompt's user positions), as transformers' `get_rope_index` gives them: it lays out only vision grids
(an image over its grid's rows and columns), so a prompt without images, audio or not, has the plain positions
0..T-1 on all three axes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_PLAIN: dict[torch.device, torch.Tensor] = {}  # [3, N] plain positions per device, sliced for each prompt


def rope_positions(model, ids: Sequence[int], audio_lengths: torch.Tensor | None,
                   image_grid_thw: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """(positions [3, T] on `device`, the offset of the positions after them). Without images: a view of one
    shared tensor, no device work and no host round trip (a prompt's `get_rope_index` has several)."""
    if image_grid_thw is None:
        return plain_positions(len(ids), device), 0
    ids_t = torch.tensor([list(ids)], device=device)
    pos, delta = model.get_rope_index(ids_t, image_grid_thw.to(device), None, torch.ones_like(ids_t), False,
                                      None if audio_lengths is None else audio_lengths.to(device), None)
    return pos[:, 0].long(), int(delta.flatten()[0])


def plain_positions(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 on all three axes, [3, n] (a view: read only)."""
    table = _PLAIN.get(device)
    if table is None or table.shape[1] < n:
        with torch.inference_mode():
            table = _PLAIN[device] = torch.arange(max(n, 4096), device=device).expand(3, -1)
    return table[:, :n]
