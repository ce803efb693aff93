"""Drive a transformers decoder stack (its own layers, norms and rotary tables) over a slot cache.

The layers are transformers' modules, so the numerics are the reference's; only the cache and the
position bookkeeping are ours. Batches are padded [B, T] with per-row starts and lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from pipeline.kv_cache import CacheView


def run_decoder(stack: torch.nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor, view: CacheView,
                tap_layer: int | None = None, layers: Sequence[torch.nn.Module] | None = None,
                deepstack: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (final normed hidden [B,T,H], hidden after `tap_layer` layers or None).

    `tap_layer` counts like transformers' `hidden_states` tuple: 0 is the embeddings, k the output of
    layer k, and the last index the normed output. `layers`: the stack's layers as they run (compiled
    ones, `pipeline/compile.py`), by default the stack's own. `deepstack` [L, B, T, H]: added to the output
    of each of the first L layers (Qwen3's deepstack visual rows, zero off the image positions), after the
    tap reads it, as transformers records a layer's output before its `_deepstack_process`.
    """
    position_embeddings = stack.rotary_emb(embeds, position_ids)
    hidden, tapped = embeds, embeds if tap_layer == 0 else None
    num_layers = len(stack.layers)
    for i, layer in enumerate(layers or stack.layers):
        view.select_layer(i)  # the layer's buffers as tensors: a compiled layer then serves every layer
        hidden = layer(hidden, attention_mask=view.mask, cache=view, position_embeddings=position_embeddings)
        if tap_layer == i + 1 and tap_layer < num_layers:
            tapped = hidden
        if deepstack is not None and i < len(deepstack):
            hidden = hidden + deepstack[i]
    normed = stack.norm(hidden)
    if tap_layer == num_layers:
        tapped = normed
    return normed, tapped


@contextlib.contextmanager
def experts_implementation(stack: torch.nn.Module, name: str | None):
    """Run a MoE stack with another transformers experts implementation for a while: batched_mm inside
    captured decode graphs when grouped_mm cannot be captured (outside bf16 its fallback reads the group
    sizes on the host), grouped_mm for everything else (it reads each active expert once)."""
    config = stack.config
    saved = config._experts_implementation
    if name is not None:
        config._experts_implementation = name
    try:
        yield
    finally:
        config._experts_implementation = saved


def last_rows(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The hidden state of each row's last valid position: [B, H] (`lengths` on the device, as a step's
    `CacheView` holds them: no host copy)."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad a list of [T_i, ...] tensors into [B, T_max, ...] (zeros)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
