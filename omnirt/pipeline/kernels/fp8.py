"""FP8 weights of MoE experts and linear layers: block-scaled float8_e4m3fn, as the published FP8 checkpoints of
Qwen3 MoE models hold theirs (`quantization_config`: `quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128,
128]`): each block of `block` x `block` weights shares one float32 `scale_inv`, and weight ~= fp8 value x scale_inv.

The experts hold most of an MoE model's weights (the Thinker's 48 layers x 128 experts are ~29 B of its ~30 B
parameters), and a decode step reads each active expert's weights once: FP8 halves both the memory and the bytes a
step reads. Which layers a model quantises is the model's to say (`omnirt/pipeline/models/`).

The arithmetic stays in the activations' dtype (weight-only FP8, "W8A16"): the fused Triton experts
(`omnirt.pipeline.kernels.moe`) and `Fp8Linear`'s kernel (`triton_fp8.py`) widen each weight tile and apply its
block's scale in the accumulator; where they do not run (the CPU), `dequantized_experts_forward` and `Fp8Linear`
widen the weights and run the eager math.

Those kernels are made for decode steps (a few rows, bound by reading the weights). A prefill chunk of thousands of
rows is bound by arithmetic instead, where their small row tiles waste the tensor cores: past `WIDE_ROWS` rows (a
linear layer) or `moe.MAX_FUSED_PAIRS` pairs (experts), the weights are widened on the device in one pass
(`widened`, about a millisecond for a Thinker experts layer) and cuBLAS or grouped_mm runs on them, as in bf16.
"""

from __future__ import annotations

import torch

from omnirt.pipeline.kernels.triton_runtime import INTERPRETER

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


WIDE_ROWS = 256  # rows past which Fp8Linear widens its weight (decode steps have at most 64 rows, two tokens each)
WIDEN_TILE = 64  # rows and columns of widen_kernel's tile


def widened(q: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_blocks` through the Triton kernel: one read of the fp8 weights [..., N, K] and one write in
    `dtype`, with no float32 copies (the eager formula holds about 5 GB at once for a Thinker experts layer)."""
    return _widen_op(q, scale_inv, block, dtype)


@torch.library.custom_op("omnirt::widen_fp8", mutates_args=())
def _widen_op(q: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    import triton

    from omnirt.pipeline.kernels.triton_fp8 import widen_kernel  # deferred: Triton is optional

    n, k = q.shape[-2:]
    q3, s3 = q.reshape(-1, n, k).contiguous(), scale_inv.reshape(-1, *scale_inv.shape[-2:])
    out = torch.empty(q3.shape, dtype=dtype, device=q.device)
    with INTERPRETER:
        widen_kernel[(q3.shape[0], triton.cdiv(n, WIDEN_TILE), triton.cdiv(k, WIDEN_TILE))](
            q3, s3, out, n, k, q3.stride(0), s3.stride(0), s3.stride(1), SCALE_BLOCK=block, BLOCK_N=WIDEN_TILE,
            BLOCK_K=WIDEN_TILE)
    return out.view(q.shape)


@_widen_op.register_fake
def _(q, scale_inv, block, dtype):
    return q.new_empty(q.shape, dtype=dtype)


class WidenedExperts:
    """An FP8 experts module seen with its projections widened to `dtype` (the rest is the module's own): what
    transformers' grouped_mm forward reads for a prefill chunk."""

    def __init__(self, experts: torch.nn.Module, dtype: torch.dtype):
        self._experts = experts
        block = experts.weight_block_size[0]
        for name in PROJECTIONS:
            setattr(self, name, widened(getattr(experts, name), getattr(experts, f"{name}_scale_inv"), block, dtype))

    def __getattr__(self, name: str):
        return getattr(self._experts, name)


def is_quantized(experts: torch.nn.Module) -> bool:
    return getattr(experts, "gate_up_proj_scale_inv", None) is not None


def hold(module: torch.nn.Module, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """FP8 weights `name` and their scales `<name>_scale_inv` as buffers, replacing a parameter of that name: a
    transformers model's `dtype` (its first floating-point parameter) stays the engine's."""
    if name in module._parameters:
        delattr(module, name)
    module.register_buffer(name, weight)
    module.register_buffer(f"{name}_scale_inv", scale_inv)


def quantize_experts(experts: torch.nn.Module, block: int = BLOCK) -> None:
    """Replace an experts module's weights by fp8 ones in place, with `<proj>_scale_inv` and `weight_block_size`
    beside them, as an FP8 checkpoint's experts load. Each projection's bf16 copy is freed as it goes."""
    for name in PROJECTIONS:
        hold(experts, name, *quantize_blocks(getattr(experts, name).data, block))
    experts.weight_block_size = (block, block)


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


class Fp8Linear(torch.nn.Module):
    """An `nn.Linear` whose weight is FP8 with block scales (`weight`, `weight_scale_inv`, as FP8 checkpoints name
    them). `fused`: through the Triton kernel (a device, or the interpreter in tests); else the weight widened."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: int, bias: torch.Tensor | None,
                 fused: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        hold(self, "weight", weight, scale_inv)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.block, self.fused = block, fused

    @classmethod
    def quantized(cls, linear: torch.nn.Linear, block: int = BLOCK, fused: bool = False) -> Fp8Linear:
        q, scale = quantize_blocks(linear.weight.data, block)
        return cls(q, scale, block, None if linear.bias is None else linear.bias.data, fused)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return torch.nn.functional.linear(x, self.dequantized_weight(x.dtype), self.bias)
        if x.numel() > WIDE_ROWS * self.in_features:
            weight = widened(self.weight, self.weight_scale_inv, self.block, x.dtype)
            return torch.nn.functional.linear(x, weight, self.bias)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks of {self.block}"


LINEAR_TILES = (16, 64, 128, 4, 3)  # BLOCK_M, BLOCK_N, BLOCK_K (shrunk to the scale block), warps, stages


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (FP8 weight [N, K] x its block scales)^T (+ bias), in x's dtype, through the Triton kernel."""
    return _fp8_linear_op(x, weight, scale_inv, block, bias)


@torch.library.custom_op("omnirt::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    import math

    import triton

    from omnirt.pipeline.kernels.triton_fp8 import fp8_linear_kernel  # deferred: Triton is optional

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    (m, k), n = rows.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = LINEAR_TILES
    block_k = math.gcd(block_k, block)
    with INTERPRETER:
        fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            rows, weight, scale_inv, weight if bias is None else bias, y, m, n, k, rows.stride(0), weight.stride(0),
            scale_inv.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, SCALE_BLOCK=block, PRECISION="ieee" if x.dtype == torch.float32 else None,
            num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n)


@_fp8_linear_op.register_fake
def _(x, weight, scale_inv, block, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
