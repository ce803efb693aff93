"""Attention that reads the slot KV cache in place.

The cache keeps each request's keys and values in row `slot` of a [slots + 1, kv_heads, max_len,
head_dim] buffer per layer. Gathering those rows into a dense copy for every layer of every step cost
more than the attention itself (0.83 s of a 9.45 s c=64 round on the H200). This Triton kernel indexes
the buffer by slot instead, with flash attention's online softmax. One program takes one batch row,
one KV head and a block of (new token, query head) pairs, so each key block is loaded once for the
whole GQA group. Prefill chunks (causal within the new tokens, ragged lengths) and decode steps (one
token) use the same kernel, and its loop bound is read from device tensors, so one captured graph per
batch size serves every sequence length.

The kernel itself is `omnirt/pipeline/kernels/triton_attention.py`, imported on first use. On the CPU it runs under
Triton's interpreter (`TRITON_INTERPRET=1`, set before it is imported): that is how the tests check it
against the reference attention. The launch is a torch custom op (`omnirt::slot_attention`), opaque to
`torch.compile`: compiled decode steps fuse the glue around it and call the kernel as it is, on the
device and under the interpreter alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnirt.pipeline.kernels.triton_runtime import INTERPRETER

NAME = "omnirt_slots"  # the transformers attention implementation this module registers


@dataclass(slots=True)
class SlotMask:
    """What the kernel needs instead of a dense mask: per batch row its slot, the position of its first
    new token and how many of the step's tokens are real (the rest are padding)."""

    slots: torch.Tensor  # [B] long
    starts: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [B] long


def slot_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: SlotMask,
                   scale: float) -> torch.Tensor:
    """query [B, H, T, D] attends over its slot's keys [0, start + t]; returns [B, T, H, D] (rows past a
    row's length are zero). k_cache / v_cache: one layer, [slots + 1, kv_heads, max_len, D]."""
    return _slot_attention_op(query, k_cache, v_cache, mask.slots, mask.starts, mask.lengths, scale)


@torch.library.custom_op("omnirt::slot_attention", mutates_args=())
def _slot_attention_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                       starts: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    import triton

    from omnirt.pipeline.kernels.triton_attention import slot_attention_kernel  # deferred: Triton is optional

    b, heads, t, d = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    # padded rows of a prefill chunk are not written: zeros keep them finite in the layers after this one
    out = (torch.empty if t == 1 else torch.zeros)(b, t, heads, d, dtype=query.dtype, device=query.device)
    block_m = min(64, max(16, triton.next_power_of_2(t * group)))
    grid = (b, kv_heads, triton.cdiv(t * group, block_m))
    with INTERPRETER:
        slot_attention_kernel[grid](
            query, k_cache, v_cache, out, slots, starts, lengths, scale * math.log2(math.e),
            query.stride(0), query.stride(1), query.stride(2), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), out.stride(0), out.stride(1), out.stride(2), t,
            GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=64,
            PRECISION="ieee" if query.dtype == torch.float32 else None)
    return out


@_slot_attention_op.register_fake
def _(query, k_cache, v_cache, slots, starts, lengths, scale):
    b, heads, t, d = query.shape
    return query.new_empty(b, t, heads, d)


def attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The transformers attention interface: the slot kernel when the layer's cache passed a `SlotMask`
    (its key/value are then the whole layer buffers), SDPA for anything else (e.g. the reference
    engine's generate() on the same modules)."""
    if isinstance(attention_mask, SlotMask):
        return slot_attention(query, key, value, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def attend_in_place(config) -> None:
    """Make the layers built from `config` call `attention_forward` (registered once with transformers)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    config._attn_implementation = NAME
