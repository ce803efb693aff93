"""MoE experts as fused Triton kernels, registered as a transformers experts implementation.

transformers' grouped_mm path sorts the (token, expert) pairs, builds group offsets, gathers the hidden
rows, runs two grouped GEMMs with the gate between them, weights, un-permutes and sums: a dozen kernels
per MoE layer, where a decode step at batch <= 64 is memory bound and only needs each active expert's
weights read once. This runs four, in the style of vLLM's fused_moe: align the pairs into blocks of
BLOCK_M that share an expert (one program, no host sync), gate/up with SiLU(gate) * up in its epilogue,
down with the routing weight in its epilogue, and the sum over top-k. Every buffer has its worst-case
size, so a step captures in a CUDA graph in any dtype.

Calls with more than `MAX_FUSED_PAIRS` pairs (long prefill chunks) go to grouped_mm instead: they are
compute bound, the one-program align walks every pair, and BLOCK_M 16 tiles re-read an expert's weights
for every block of its pairs.

The kernels are `omnirt/pipeline/kernels/triton_moe.py`, imported on first use; on the CPU they run under Triton's
interpreter, which is how the tests check them against transformers' eager experts. The launch is a torch
custom op (`omnirt::fused_experts`), opaque to `torch.compile` as the slot attention is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from omnirt.pipeline.kernels.triton_runtime import INTERPRETER

NAME = "omnirt_triton"  # the transformers experts implementation this module registers
MAX_FUSED_PAIRS = 2048  # tokens * top_k; decode steps have at most 64 * 8
ALIGN_CHUNK = 32  # pairs the align kernel takes at a time ([ALIGN_CHUNK, experts] one-hot tiles)


@dataclass(frozen=True, slots=True)
class Tiles:
    """Tile sizes of the two GEMMs; block_m is also what each expert's pairs are padded to."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


DECODE_TILES = Tiles()


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded to block_m with the sentinel `pairs` [blocks *
    block_m], the expert of each block [blocks], the padded total [1]); int32, sized for the worst case:
    every hit expert's run may need block_m - 1 pads. Rows past the total are left unwritten."""
    import triton

    from omnirt.pipeline.kernels.triton_moe import align_kernel  # deferred: Triton is optional

    pairs = top_k_index.numel()
    blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    device = top_k_index.device
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    with INTERPRETER:
        align_kernel[(1,)](top_k_index.reshape(-1), sorted_ids, block_expert, total, pairs, blocks,
                           NUM_EXPERTS=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=ALIGN_CHUNK)
    return sorted_ids, block_expert, total


def fused_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, transposed: bool = False, tiles: Tiles = DECODE_TILES,
                  scales: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """sum over k of w[t, k] * down_e(SiLU(gate_e(x_t)) * up_e(x_t)), e = top_k_index[t, k], for hidden [T, H].
    Weights as transformers holds them: gate_up [E, 2I, H] (gate rows first), down [E, H, I]; transposed,
    [E, H, 2I] and [E, I, H]. `scales`: for fp8 weights (`omnirt.pipeline.kernels.fp8`, not transposed), their
    scale_inv tensors and block size; the arithmetic is then in the hidden states' dtype."""
    gate_up_scale, down_scale, block = scales if scales is not None else (None, None, 0)
    if block and (transposed or block % tiles.block_k):
        raise ValueError(f"fp8 experts need [E, N, K] weights and a reduction tile dividing their {block} blocks")
    return _fused_experts_op(hidden, gate_up, down, top_k_index, top_k_weights, transposed,
                             [tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages],
                             gate_up_scale, down_scale, block)


@torch.library.custom_op("omnirt::fused_experts", mutates_args=())
def _fused_experts_op(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, transposed: bool, tile_sizes: list[int],
                      gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None,
                      scale_block: int) -> torch.Tensor:
    import triton

    from omnirt.pipeline.kernels.triton_moe import down_kernel, gate_up_kernel  # deferred: Triton is optional

    tiles = Tiles(*tile_sizes)
    x = hidden.to(hidden.dtype if scale_block else gate_up.dtype).contiguous()
    tokens, dim = x.shape
    top_k = top_k_index.shape[1]
    pairs = tokens * top_k
    inter = gate_up.shape[2 if transposed else 1] // 2
    sorted_ids, block_expert, total = align(top_k_index, gate_up.shape[0], tiles.block_m)
    blocks = block_expert.numel()
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)  # by sorted row
    out = torch.empty(pairs, dim, dtype=x.dtype, device=x.device)  # by pair
    fixed = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                 PRECISION="ieee" if x.dtype == torch.float32 else None, SCALE_BLOCK=scale_block,
                 num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    gate_up_scale = gate_up if gate_up_scale is None else gate_up_scale  # unread without scale_block
    down_scale = down if down_scale is None else down_scale
    with INTERPRETER:
        gate_up_kernel[(blocks, triton.cdiv(inter, tiles.block_n))](
            x, gate_up, gate_up_scale, act, sorted_ids, block_expert, total, pairs, inter, dim,
            x.stride(0), *_strides(gate_up, transposed), *_strides(gate_up_scale, False), act.stride(0),
            TOP_K=top_k, **fixed)
        down_kernel[(blocks, triton.cdiv(dim, tiles.block_n))](
            act, down, down_scale, out, sorted_ids, block_expert, total, top_k_weights.reshape(-1), pairs, dim,
            inter, act.stride(0), *_strides(down, transposed), *_strides(down_scale, False), out.stride(0), **fixed)
    return out.view(tokens, top_k, dim).sum(1).to(hidden.dtype)


@_fused_experts_op.register_fake
def _(hidden, gate_up, down, top_k_index, top_k_weights, transposed, tile_sizes, gate_up_scale, down_scale,
      scale_block):
    return hidden.new_empty(hidden.shape)


def _strides(weight: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output column, reduction) strides of [E, N, K] weights, or of transposed [E, K, N] ones."""
    expert, a, b = weight.stride()
    return (expert, b, a) if transposed else (expert, a, b)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    tiles: Tiles = DECODE_TILES) -> torch.Tensor:
    """transformers' experts interface (`grouped_mm_experts_forward`'s signature), on the module's own
    weights and layout; grouped_mm past `MAX_FUSED_PAIRS`, on FP8 experts (`omnirt.pipeline.kernels.fp8`) widened
    for the call. `tiles`: for timing other tile sizes."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from omnirt.pipeline.kernels.fp8 import WidenedExperts, is_quantized

    _check_fusable(self)
    if top_k_index.numel() > MAX_FUSED_PAIRS:
        experts = WidenedExperts(self, hidden_states.dtype) if is_quantized(self) else self
        return grouped_mm_experts_forward(experts, hidden_states, top_k_index, top_k_weights)
    scales = None
    if is_quantized(self):
        block = self.weight_block_size[0]
        scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv, block)
        tiles = dataclasses.replace(tiles, block_k=math.gcd(tiles.block_k, block))  # a tile within a scale block
    return fused_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights,
                         self.is_transposed, tiles, scales)


def _check_fusable(experts: torch.nn.Module) -> None:
    """The kernels compute SiLU(gate) * up from concatenated [gate; up] weights, with no bias, no post-expert
    norm and every expert local (Qwen3-Omni's Thinker and Talker experts): refuse anything else."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    if not (experts.has_gate and experts.is_concatenated and not experts.has_bias
            and not experts.has_post_expert_norm and not experts._is_expert_parallel
            and type(experts)._apply_gate is _default_apply_gate
            and isinstance(experts.act_fn, SiLUActivation | torch.nn.SiLU)):
        raise NotImplementedError(f"{NAME} fuses SiLU(gate) * up of concatenated gate/up weights without bias; "
                                  f"{type(experts).__name__} is not built that way")


def use_fused_experts() -> str:
    """Register `experts_forward` with transformers (again is harmless) and return its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    return NAME
