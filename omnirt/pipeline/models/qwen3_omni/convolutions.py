"""Code2Wav's causal convolutions re-expressed on the same weights (`conv_backend`), for speed, not new numerics.

On the H200 cuDNN runs the vocoder's 1-D convolutions (few channels, long time axis) as an implicit GEMM with
NCHW<->NHWC transposes around every layer, at 8 % of the bf16 rate. Two formulations keep activations
time-major ([batch, time, channels] in memory, still [batch, channels, time] as tensors) from the transformer's
output to the waveform, so no layer transposes:

- `gemm`: a convolution is one matmul over its taps side by side (im2col); a transposed convolution of stride
  s and kernel n*s is one matmul to n*s output samples per input step, then an overlap-add of the n
  overlapping blocks; a depthwise convolution is a sum over its taps. The same sums in another order: equal
  to the native path up to rounding.
- `channels_last`: each Conv1d as a Conv2d of height 1 in channels_last memory format (cuDNN's NHWC kernels).
- `triton`: each residual unit as three kernels, SnakeBeta in one pass, the dilated convolution with the second
  SnakeBeta in its epilogue, the 1x1 convolution with the residual in its epilogue (`snake_conv.py`);
  the decoder's other stride-1 convolutions and SnakeBetas as one kernel each; the transposed convolutions as
  `gemm` has them, whose matmul takes time-major input and gives time-major output. So from the transformer's
  output to the waveform no layer copies its activations to another layout; the depthwise convolutions before
  the decoder stay transformers'.

`native` leaves transformers' modules as they are. Every backend first precomputes SnakeBeta's exp(alpha) and
1 / (exp(beta) + eps) once (`PrecomputedSnakeBeta`). LayerNorm and the other elementwise work keep whatever
layout their inputs have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeSnakeBeta,
)

from omnirt.pipeline.models.qwen3_omni.snake_conv import causal_conv, snake, time_major
from omnirt.pipeline.types import CONV_BACKENDS


class PrecomputedSnakeBeta(torch.nn.Module):
    """SnakeBeta with exp(alpha) and 1 / (exp(beta) + eps) computed once, not on every call (the same
    values, so the same output); frozen weights only."""

    def __init__(self, snake: Qwen3OmniMoeSnakeBeta):
        super().__init__()
        with torch.no_grad():
            self.register_buffer("alpha", snake.alpha.exp()[None, :, None])
            self.register_buffer("inv_beta", 1.0 / (snake.beta.exp()[None, :, None] + snake.no_div_by_zero))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inv_beta * torch.pow(torch.sin(x * self.alpha), 2)


class GemmConv(torch.nn.Module):
    """A causal stride-1 Conv1d (dense or depthwise) as a matmul over its time-shifted taps."""

    def __init__(self, causal: Qwen3OmniMoeCausalConvNet):
        super().__init__()
        conv = causal.conv
        self.left_pad, self.dilation, self.num_taps = causal.padding, conv.dilation[0], conv.kernel_size[0]
        self.depthwise = conv.groups > 1
        weight = conv.weight.detach()  # [out, in / groups, taps]
        # depthwise: [taps, channels]; dense: [out, taps * in], taps outermost as the shifted slices are laid out
        self.register_buffer("weight", weight[:, 0].T.contiguous() if self.depthwise
                             else weight.permute(0, 2, 1).reshape(weight.shape[0], -1).contiguous())
        self.register_buffer("bias", conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.shape[-1]
        xt = F.pad(x.transpose(1, 2), (0, 0, self.left_pad, 0))  # [batch, pad + time, channels]
        taps = [xt[:, j * self.dilation: j * self.dilation + steps] for j in range(self.num_taps)]
        if self.depthwise:
            out = sum(tap * w for tap, w in zip(taps, self.weight, strict=True)) + self.bias
        else:
            out = F.linear(taps[0] if len(taps) == 1 else torch.cat(taps, dim=-1), self.weight, self.bias)
        return out.transpose(1, 2)


class GemmTransConv(torch.nn.Module):
    """A causal ConvTranspose1d of kernel n * stride as one matmul and an overlap-add of n blocks."""

    def __init__(self, causal: Qwen3OmniMoeCausalTransConvNet):
        super().__init__()
        conv = causal.conv
        self.stride, kernel = conv.stride[0], conv.kernel_size[0]
        self.num_blocks = kernel // self.stride
        weight = conv.weight.detach()  # [in, out, kernel]
        self.register_buffer("weight", weight.permute(2, 1, 0).reshape(-1, weight.shape[0]).contiguous())
        self.register_buffer("bias", conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, steps = x.shape
        n = self.num_blocks
        y = F.linear(x.transpose(1, 2), self.weight).view(batch, steps, n, self.stride, -1)
        # output block b sums input step b - j's j-th block; the causal trim drops n - 1 blocks at each end
        out = y[:, n - 1:, 0] + self.bias
        for j in range(1, n):
            out += y[:, n - 1 - j: steps - j, j]
        return out.reshape(batch, (steps - n + 1) * self.stride, -1).transpose(1, 2)


class ChannelsLastConv(torch.nn.Module):
    """A causal stride-1 Conv1d as a Conv2d of height 1 over channels_last activations."""

    def __init__(self, causal: Qwen3OmniMoeCausalConvNet):
        super().__init__()
        conv = causal.conv
        self.left_pad, self.dilation, self.groups = causal.padding, conv.dilation[0], conv.groups
        self.register_buffer("weight", _channels_last(conv.weight.detach().unsqueeze(2)))
        self.register_buffer("bias", conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x4 = _channels_last(F.pad(x.unsqueeze(2), (self.left_pad, 0)))
        return F.conv2d(x4, self.weight, self.bias, dilation=(1, self.dilation), groups=self.groups).squeeze(2)


class ChannelsLastTransConv(torch.nn.Module):
    """A causal ConvTranspose1d as a ConvTranspose2d of height 1 over channels_last activations."""

    def __init__(self, causal: Qwen3OmniMoeCausalTransConvNet):
        super().__init__()
        conv = causal.conv
        self.stride, self.left_pad, self.right_pad = conv.stride[0], causal.left_pad, causal.right_pad
        self.register_buffer("weight", _channels_last(conv.weight.detach().unsqueeze(2)))
        self.register_buffer("bias", conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv_transpose2d(_channels_last(x.unsqueeze(2)), self.weight, self.bias, stride=(1, self.stride))
        return y[..., self.left_pad: y.shape[-1] - self.right_pad].squeeze(2)


class TritonConv(torch.nn.Module):
    """A causal stride-1 Conv1d as one kernel (`snake_conv.py`), with the SnakeBeta that follows it in
    its epilogue when given, and a residual added when the call passes one."""

    def __init__(self, causal: Qwen3OmniMoeCausalConvNet, snake_out: PrecomputedSnakeBeta | None = None):
        super().__init__()
        conv = causal.conv
        self.dilation = conv.dilation[0]
        self.register_buffer("weight", conv.weight.detach().permute(2, 0, 1).contiguous())  # [taps, out, in]
        self.register_buffer("bias", conv.bias.detach().clone())
        _snake_buffers(self, snake_out)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return causal_conv(x, self.weight, self.bias, self.dilation, self.alpha, self.inv_beta, residual)


class TritonSnake(torch.nn.Module):
    """SnakeBeta in one pass."""

    def __init__(self, activation: PrecomputedSnakeBeta):
        super().__init__()
        _snake_buffers(self, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha, self.inv_beta)


def _snake_buffers(module: torch.nn.Module, activation: PrecomputedSnakeBeta | None) -> None:
    """The kernels' per-channel SnakeBeta constants, flat ([C]); None where the module applies none."""
    for name in ("alpha", "inv_beta"):
        module.register_buffer(name, None if activation is None else getattr(activation, name).detach().flatten()
                               .clone())


class TritonResidualUnit(torch.nn.Module):
    """x + conv1x1(snake(conv_dilated(snake(x)))) as three kernels: SnakeBeta, the dilated convolution with the
    second SnakeBeta in its epilogue, the 1x1 convolution with the residual in its epilogue; time-major (as the
    GEMM transposed convolution before it leaves its output; an input laid out otherwise is copied once)."""

    def __init__(self, unit: Qwen3OmniMoeCode2WavDecoderResidualUnit):
        super().__init__()
        self.act1 = TritonSnake(unit.act1)
        self.conv1 = TritonConv(unit.conv1, snake_out=unit.act2)
        self.conv2 = TritonConv(unit.conv2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = time_major(x)
        return self.conv2(self.conv1(self.act1(x)), residual=x)


def _triton_conv(m: Qwen3OmniMoeCausalConvNet) -> torch.nn.Module:
    return TritonConv(m) if m.conv.stride[0] == 1 and m.conv.groups == 1 else m


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _gemm_conv(m: Qwen3OmniMoeCausalConvNet) -> torch.nn.Module:
    conv = m.conv
    dense_or_depthwise = conv.groups == 1 or conv.groups == conv.in_channels == conv.out_channels
    return GemmConv(m) if conv.stride[0] == 1 and dense_or_depthwise else m


def _gemm_trans_conv(m: Qwen3OmniMoeCausalTransConvNet) -> torch.nn.Module:
    conv = m.conv
    fits = conv.groups == 1 and conv.kernel_size[0] % conv.stride[0] == 0 and m.left_pad == m.right_pad == (
        conv.kernel_size[0] - conv.stride[0])
    return GemmTransConv(m) if fits else m


def _channels_last_conv(m: Qwen3OmniMoeCausalConvNet) -> torch.nn.Module:
    return ChannelsLastConv(m) if m.conv.stride[0] == 1 else m


_REWRITES: dict[str, dict[type, Callable[[torch.nn.Module], torch.nn.Module]]] = {
    "native": {},
    "gemm": {Qwen3OmniMoeCausalConvNet: _gemm_conv, Qwen3OmniMoeCausalTransConvNet: _gemm_trans_conv},
    "channels_last": {Qwen3OmniMoeCausalConvNet: _channels_last_conv,
                      Qwen3OmniMoeCausalTransConvNet: ChannelsLastTransConv},
    "triton": {Qwen3OmniMoeCode2WavDecoderResidualUnit: TritonResidualUnit, Qwen3OmniMoeCausalConvNet: _triton_conv,
               Qwen3OmniMoeCausalTransConvNet: _gemm_trans_conv, PrecomputedSnakeBeta: TritonSnake},
}


def replace_modules(module: torch.nn.Module, rewrites: dict[type, Callable[[torch.nn.Module], torch.nn.Module]]
                    ) -> None:
    """Swap every submodule whose type `rewrites` names for what its function returns, in place."""
    for name, child in module.named_children():
        make = rewrites.get(type(child))
        if make is not None:
            setattr(module, name, make(child))
        else:
            replace_modules(child, rewrites)


def use_conv_backend(code2wav: torch.nn.Module, backend: str) -> None:
    """Precompute SnakeBeta's constants, then re-express the vocoder's convolutions as `backend` does (module
    swaps on the same weights)."""
    if backend not in _REWRITES:
        raise ValueError(f"conv_backend must be one of {', '.join(CONV_BACKENDS)}, got {backend!r}")
    with torch.no_grad():
        replace_modules(code2wav, {Qwen3OmniMoeSnakeBeta: PrecomputedSnakeBeta})
        replace_modules(code2wav, _REWRITES[backend])
