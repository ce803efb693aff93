"""FP8 weights of MoE experts: block-scaled float8_e4m3fn, as the published FP8 checkpoints of Qwen3 MoE models hold
theirs (`quantization_config`: `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`): each block of
`block` x `block` weights shares one float32 `scale_inv`, and weight ~= fp8 value x scale_inv.

The experts hold most of an MoE model's weights (the Thinker's 48 layers x 128 experts are ~29 B of its ~30 B
parameters), and a decode step reads each active expert's weights once: FP8 halves both the memory and the bytes a
step reads. Only the experts are quantised: attention, the shared experts, the routers, the embeddings, the audio
and vision encoders and Code2Wav keep the engine's dtype.

The arithmetic stays in the activations' dtype (weight-only FP8, "W8A16"): the fused Triton experts
(`omnirt.pipeline.kernels.moe`) widen each weight tile and apply its block's scale in the accumulator, and where
they do not run (the CPU) `dequantized_experts_forward` widens the hit experts' weights and runs the eager math.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK = 128  # the published checkpoints' weight_block_size, both dimensions
NAME = "omnirt_fp8_eager"  # the experts implementation that dequantises (where the fused kernels do not run)
PROJECTIONS = ("gate_up_proj", "down_proj")  # transformers' experts weights: [E, 2I, H] and [E, H, I]


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weights, float32 scale_inv [..., ceil(N / block), ceil(K / block)]) of `weight` [..., N, K]: each block's
    largest magnitude maps to FP8's largest (448). A block of zeros gets scale 1 (its values stay 0)."""
    *lead, n, k = weight.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = weight if (n % block, k % block) == (0, 0) else \
        torch.nn.functional.pad(weight, (0, kb * block - k, 0, nb * block - n))
    blocks = padded.reshape(*lead, nb, block, kb, block)  # transients: one fp32 copy (an expert layer on a GPU)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = blocks.float().div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return q.contiguous(), scale.reshape(*lead, nb, kb)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights [..., N, K] that fp8 values and their block scales stand for, in `dtype`."""
    n, k = q.shape[-2:]
    scale = scale_inv.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * scale).to(dtype)


def is_quantized(experts: torch.nn.Module) -> bool:
    return getattr(experts, "gate_up_proj_scale_inv", None) is not None


def quantize_experts(experts: torch.nn.Module, block: int = BLOCK) -> None:
    """Replace an experts module's weights by fp8 ones in place, with `<proj>_scale_inv` and `weight_block_size`
    beside them, as an FP8 checkpoint's experts load. Each projection's bf16 copy is freed as it goes."""
    for name in PROJECTIONS:
        weight = getattr(experts, name)
        q, scale = quantize_blocks(weight.data, block)
        setattr(experts, name, torch.nn.Parameter(q, requires_grad=False))
        setattr(experts, f"{name}_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
        del weight
    experts.weight_block_size = (block, block)


def quantize_moe(model: torch.nn.Module, block: int = BLOCK) -> int:
    """Quantise every experts module of `model` held off the meta device and not FP8 already; returns how many."""
    found = [m for m in model.modules() if all(isinstance(getattr(m, p, None), torch.Tensor) for p in PROJECTIONS)
             and not m.gate_up_proj.is_meta and m.gate_up_proj.dim() == 3 and not is_quantized(m)]
    for experts in found:
        quantize_experts(experts, block)
    return len(found)


def dequantized(experts: torch.nn.Module, name: str, index: int | slice, dtype: torch.dtype) -> torch.Tensor:
    """Projection `name` of expert(s) `index`, widened to `dtype`."""
    return dequantize_blocks(getattr(experts, name)[index], getattr(experts, f"{name}_scale_inv")[index],
                             experts.weight_block_size[0], dtype)


def dequantized_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface over fp8 weights: each hit expert's weights widened, then the eager math
    (SiLU(gate) * up, down, times the routing weight, summed over top-k). Where the fused kernels do not run."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        token, k = torch.where(top_k_index == expert)
        x = hidden_states[token]
        gate, up = torch.nn.functional.linear(x, dequantized(self, "gate_up_proj", expert, x.dtype)).chunk(2, dim=-1)
        y = torch.nn.functional.linear(self.act_fn(gate) * up, dequantized(self, "down_proj", expert, x.dtype))
        out.index_add_(0, token, y * top_k_weights[token, k, None].to(y.dtype))
    return out


def use_dequantized_experts() -> str:
    """Register `dequantized_experts_forward` with transformers (again is harmless) and return its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, dequantized_experts_forward)
    return NAME
