"""Code2Wav's convolutions as Triton kernels with SnakeBeta and the residual in their epilogues (`conv_backend:
triton`; under Triton's interpreter on the CPU): the kernels against F.conv1d and SnakeBeta at awkward sizes, and
the tiny vocoder with every residual unit fused against transformers' modules, window by window, to float32
rounding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omnirt.pipeline.models.qwen3_omni.code2wav import Code2WavModel, CodecWindow
from omnirt.pipeline.models.qwen3_omni.convolutions import (
    GemmTransConv,
    PrecomputedSnakeBeta,
    TritonConv,
    TritonResidualUnit,
    TritonSnake,
)
from omnirt.pipeline.models.qwen3_omni.snake_conv import causal_conv, is_time_major, snake, time_major
from tests.test_attention import CUDA, on_cuda

DEVICE = "cuda" if CUDA else "cpu"
# compiled on a GPU (bf16 as served, and fp32); interpreted on the CPU (fp32: numpy has no bf16)
DTYPES = [(torch.float32, 1e-5), on_cuda(torch.bfloat16, 2e-2, id="bf16")]
# the tiny vocoder's CPU runs need the interpreter, which conftest turns on only where there is no GPU
cpu_only = pytest.mark.skipif(CUDA, reason="runs the kernels on CPU tensors under Triton's interpreter")


def snake_reference(x, alpha, inv_beta) -> torch.Tensor:
    return x + inv_beta[None, :, None] * torch.sin(x * alpha[None, :, None]) ** 2


def reference(x, weight, bias, dilation, alpha=None, inv_beta=None, residual=None) -> torch.Tensor:
    """transformers' order in float32: left padding (K - 1) * dilation, Conv1d, SnakeBeta, + residual."""
    out = F.conv1d(F.pad(x, ((weight.shape[-1] - 1) * dilation, 0)), weight, bias, dilation=dilation)
    if alpha is not None:
        out = snake_reference(out, alpha, inv_beta)
    return out if residual is None else out + residual


@pytest.mark.parametrize("dtype,rtol", DTYPES)
@pytest.mark.parametrize("layout", ["channels_first", "time_major"])
@pytest.mark.parametrize("batch,c_in,c_out,steps,taps,dilation,with_snake,with_residual", [
    (2, 24, 40, 37, 7, 3, True, False),  # channels off the tile sizes, a dilated window
    (3, 40, 40, 200, 1, 1, True, True),  # the unit's 1x1 convolution with the residual
    (1, 17, 1, 50, 7, 1, True, False),  # the last layer: one output channel
    (2, 33, 48, 5, 7, 9, False, False),  # a dilated window longer than the input: mostly padding
])
def test_kernel_equals_causal_conv_then_snake(dtype, rtol, layout, batch, c_in, c_out, steps, taps, dilation,
                                              with_snake, with_residual):
    """Either memory layout in, the same layout out; a residual in the other layout is accepted too."""
    g = torch.Generator().manual_seed(batch * 100 + c_in)
    x = torch.randn(batch, c_in, steps, generator=g)
    weight = torch.randn(c_out, c_in, taps, generator=g) / (c_in * taps) ** 0.5
    bias, residual = torch.randn(c_out, generator=g), torch.randn(batch, c_out, steps, generator=g)
    alpha, inv_beta = torch.rand(c_out, generator=g) + 0.5, torch.rand(c_out, generator=g) + 0.5
    snake_args = (alpha, inv_beta) if with_snake else (None, None)
    expected = reference(x, weight, bias, dilation, *snake_args, residual if with_residual else None)

    def on(t):
        return None if t is None else t.to(DEVICE, dtype)

    x_in = time_major(on(x)) if layout == "time_major" else on(x)
    out = causal_conv(x_in, on(weight.permute(2, 0, 1).contiguous()), on(bias), dilation,
                      *map(on, snake_args), on(residual) if with_residual else None)
    assert out.shape == expected.shape and out.dtype == dtype
    assert is_time_major(out) == (layout == "time_major")
    assert ((out.float().cpu() - expected).norm() / expected.norm()) < rtol


@pytest.mark.parametrize("dtype,rtol", DTYPES)
@pytest.mark.parametrize("layout", ["channels_first", "time_major", "strided"])
def test_snake_alone(dtype, rtol, layout):
    g = torch.Generator().manual_seed(5)
    x, alpha, inv_beta = torch.randn(3, 20, 70, generator=g), torch.rand(20, generator=g), torch.rand(20, generator=g)
    expected = snake_reference(x, alpha, inv_beta)
    layouts = {"channels_first": x, "time_major": time_major(x),
               "strided": x.transpose(0, 1).contiguous().transpose(0, 1)}  # neither: copied
    x_in = layouts[layout].to(DEVICE, dtype)
    out = snake(x_in, alpha.to(DEVICE), inv_beta.to(DEVICE))
    assert is_time_major(out) == (layout == "time_major")
    assert ((out.float().cpu() - expected).norm() / expected.norm()) < rtol


@pytest.fixture(scope="module")
def vocoders(reference_model):
    """The tiny Code2Wav as transformers' modules and with the Triton backend, float32 on the CPU."""
    def build(backend):
        return Code2WavModel(copy.deepcopy(reference_model.code2wav), torch.device("cpu"), conv_backend=backend)
    return build("native"), build("triton")


@cpu_only
def test_every_residual_unit_runs_as_three_kernels(vocoders):
    """Per residual unit one SnakeBeta pass and two convolutions, the first with the second SnakeBeta in its
    epilogue; every stride-1 convolution and SnakeBeta of the decoder a kernel; no eager SnakeBeta left."""
    decoder = vocoders[1].code2wav.decoder
    kinds = [type(m) for m in decoder.modules()]
    blocks = len(vocoders[1].code2wav.config.upsample_rates)
    assert kinds.count(TritonConv) == blocks * 3 * 2 + 2  # + the first and the last
    assert kinds.count(TritonSnake) == blocks * 3 + blocks + 1  # + one before each transposed conv, the last
    assert PrecomputedSnakeBeta not in kinds
    assert sum(m.alpha is not None for m in decoder.modules() if isinstance(m, TritonConv)) == blocks * 3


@cpu_only
def test_decoder_activations_stay_time_major_from_first_to_last_layer(vocoders, reference_model):
    """Every transposed convolution is the GEMM form and every residual unit gets time-major input, so no layer
    of the decoder copies its activations to another layout (the copies a cuDNN transposed convolution needs)."""
    decoder = vocoders[1].code2wav.decoder
    blocks = len(vocoders[1].code2wav.config.upsample_rates)
    assert sum(isinstance(m, GemmTransConv) for m in decoder.modules()) == blocks
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: inputs.append(is_time_major(args[0])))
             for m in decoder.modules() if isinstance(m, TritonResidualUnit)]
    try:
        size = reference_model.config.code2wav_config.codebook_size
        vocoders[1].decode([CodecWindow(torch.randint(0, size, (5, 16)).tolist(), 0, True)])
    finally:
        for h in hooks:
            h.remove()
    assert inputs == [True] * blocks * 3


@cpu_only
def test_vocoder_decodes_a_batch_of_windows_as_transformers_modules_do(vocoders, reference_model):
    """A first window and a later one with left context, of different lengths in one padded batch: the same
    samples (float32 rounding) and the same counts as the native modules."""
    native, fused = vocoders
    size = reference_model.config.code2wav_config.codebook_size
    g = torch.Generator().manual_seed(11)
    windows = [CodecWindow(torch.randint(0, size, (n, 16), generator=g).tolist(), ctx, ctx == 0)
               for n, ctx in ((3, 0), (6, 4))]
    expected, got = native.decode(windows), fused.decode(windows)
    assert fused.tail == native.tail > 0
    for w, e, o in zip(windows, expected, got, strict=True):
        assert len(o) == len(e) == (len(w.codes) - w.num_context) * native.samples_per_frame - (
            native.tail if w.is_first else 0)
        assert np.abs(o - e).max() < 1e-5
    assert max(np.abs(e).max() for e in expected) > 0.05  # audible, not near-silence
