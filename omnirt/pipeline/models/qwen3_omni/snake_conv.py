"""Code2Wav's causal convolutions with the SnakeBeta after them and the residual add in their epilogue: one
kernel where eager runs about eight.

A BigVGAN-style residual unit is SnakeBeta -> causal Conv1d -> SnakeBeta -> Conv1d(k=1) -> + residual. Eager,
each SnakeBeta is five full-size elementwise kernels and each causal convolution a padded copy plus cuDNN's
implicit GEMM with NCHW<->NHWC transposes around it (8 % of the bf16 rate on an H200). Here the unit is three
kernels: SnakeBeta in one pass, the dilated convolution with the second SnakeBeta in its epilogue, and the 1x1
convolution with the residual added before its store (`triton_conv.py`), on activations laid out
time-major (`time_major`: each tap then loads whole aligned rows of channels). Tiles follow the channel
counts (no start-up tuning); on the CPU the kernels run under Triton's interpreter, which is how the tests check
them against transformers' modules.

The launches are torch custom ops (`omnirt::causal_conv`, `omnirt::snake`), opaque to `torch.compile`.
"""

from __future__ import annotations

import os

import torch

from omnirt.pipeline.kernels.triton_runtime import INTERPRETER

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SNAKE_BLOCK = 8192 if INTERPRETING else 2048


def is_time_major(x: torch.Tensor) -> bool:
    """A [B, C, T] tensor whose memory is [B, T, C] (the transpose of a contiguous one)."""
    return x.stride(1) == 1 and x.stride(2) == x.shape[1] and x.stride(0) == x.shape[1] * x.shape[2]


def time_major(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] with its memory laid out [B, T, C] (one copy unless it already is)."""
    return x if is_time_major(x) else x.transpose(1, 2).contiguous().transpose(1, 2)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x itself when its memory is [B, C, T] or [B, T, C]; else a [B, C, T] copy."""
    return x if x.is_contiguous() or is_time_major(x) else x.contiguous()


def _like(x: torch.Tensor, channels: int) -> torch.Tensor:
    """An empty [B, channels, T] tensor laid out as x is."""
    batch, _, steps = x.shape
    if is_time_major(x):
        return torch.empty(batch, steps, channels, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(batch, channels, steps, dtype=x.dtype, device=x.device)


def conv_tiles(c_in: int, c_out: int) -> dict[str, int]:
    """Tile sizes and launch settings from the channel counts. The interpreter's cost is per program and per
    operation on whole tiles, so there time tiles are long and channel tiles no wider than the channels."""
    import triton

    if INTERPRETING:
        return {"BLOCK_CO": min(64, max(16, triton.next_power_of_2(c_out))),
                "BLOCK_CI": min(64, max(16, triton.next_power_of_2(c_in))), "BLOCK_T": 4096}
    wide = c_out >= 128
    return {"BLOCK_CO": 128 if wide else 64, "BLOCK_CI": 64 if c_in % 64 == 0 else 32, "BLOCK_T": 128,
            "num_warps": 8 if wide else 4, "num_stages": 3}


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int,
                alpha: torch.Tensor | None = None, inv_beta: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """snake(conv(x) + bias) (+ residual): x [B, C_in, T]; weight [K, C_out, C_in] (taps first); a causal
    convolution of `dilation` (left padding (K - 1) * dilation, output length T). Without `alpha` no SnakeBeta;
    `alpha`, `inv_beta` are the output channels'. The output is laid out as x is ([B, C, T] or time-major)."""
    return _causal_conv_op(x, weight, bias, dilation, alpha, inv_beta, residual)


@torch.library.custom_op("omnirt::causal_conv", mutates_args=())
def _causal_conv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, dilation: int,
                    alpha: torch.Tensor | None, inv_beta: torch.Tensor | None,
                    residual: torch.Tensor | None) -> torch.Tensor:
    import triton

    from omnirt.pipeline.models.qwen3_omni.triton_conv import conv_kernel  # deferred: Triton is optional

    x = _dense(x)
    batch, c_in, steps = x.shape
    taps, c_out, _ = weight.shape
    out = _like(x, c_out)
    res = out if residual is None else residual  # the kernel reads the residual with the output's strides
    if res.stride() != out.stride():
        res = _like(x, c_out).copy_(residual)
    tiles = conv_tiles(c_in, c_out)
    grid = (triton.cdiv(steps, tiles["BLOCK_T"]), triton.cdiv(c_out, tiles["BLOCK_CO"]), batch)
    with INTERPRETER:
        conv_kernel[grid](x, weight, bias, alpha if alpha is not None else bias,
                          inv_beta if inv_beta is not None else bias, res, out, c_in, c_out, steps, dilation,
                          *x.stride(), *out.stride(), K=taps, SNAKE_OUT=alpha is not None,
                          HAS_RES=residual is not None, PRECISION="ieee" if x.dtype == torch.float32 else None, **tiles)
    return out


@_causal_conv_op.register_fake
def _(x, weight, bias, dilation, alpha, inv_beta, residual):
    return _like(x, weight.shape[1])


@torch.library.custom_op("omnirt::snake", mutates_args=())
def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] with per-channel exp(alpha) and 1 / (exp(beta) + eps), in one pass."""
    import triton

    from omnirt.pipeline.models.qwen3_omni.triton_conv import snake_kernel  # deferred: Triton is optional

    x = _dense(x)
    batch, channels, steps = x.shape
    out = _like(x, channels)
    with INTERPRETER:
        snake_kernel[(triton.cdiv(x.numel(), SNAKE_BLOCK),)](x, alpha, inv_beta, out, x.numel(), channels, steps,
                                                            TIME_MAJOR=is_time_major(x), BLOCK=SNAKE_BLOCK)
    return out


@snake.register_fake
def _(x, alpha, inv_beta):
    return _like(x, x.shape[1])
