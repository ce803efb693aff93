"""Qwen3-Omni Code2Wav as a batched stage model: windows of codec frames in, PCM out.

A window is [left context | new frames]. The vocoder is causal, so the output for the first T
frames of any decode is final except its last `tail` samples (the right-trim of the causal
transposed convolutions, 555 for the real upsample rates). Each chunk therefore starts `tail`
samples before its first new frame, re-emitting what the previous chunk withheld: consecutive
chunks join without the hole that transformers' `chunked_decode` leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
)

from omnirt.pipeline.models.qwen3_omni.convolutions import use_conv_backend
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.compile import RECOMPILE_LIMIT
from omnirt.pipeline.stage.cudagraph import CudaGraphCache, batch_buckets


@dataclass(slots=True, frozen=True)
class CodecWindow:
    codes: list[list[int]]  # [frames][16], left context first
    num_context: int  # frames of left context at the front
    is_first: bool  # the request's first chunk: nothing withheld before it


def pcm16(wav: np.ndarray) -> bytes:
    """Samples in [-1, 1] as the clients take them: mono little-endian int16."""
    return (np.clip(wav, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def samples_per_frame(c2w_config) -> int:
    """StageOutput samples per codec frame: the product of the upsampling rates (1920 for Qwen3-Omni)."""
    return math.prod((*c2w_config.upsample_rates, *c2w_config.upsampling_ratios))


def frame_seconds(c2w_config, sample_rate: int) -> float:
    """Seconds of audio one codec frame decodes to (80 ms at Qwen3-Omni's 24 kHz)."""
    return samples_per_frame(c2w_config) / sample_rate


def receptive_field_frames(code2wav) -> int:
    """Frames of left context a window needs for its new samples to equal the one-shot decode's: each
    sliding-window attention layer reaches `sliding_window - 1` frames further back (they compound), each
    causal convolution `kernel - 1` samples at its rate (the transposed ones only look ahead: `tail`)."""
    cfg = code2wav.config
    frames, rate, samples_back = cfg.num_hidden_layers * (cfg.sliding_window - 1), 1, 0.0
    for module in (*code2wav.upsample.modules(), *code2wav.decoder.modules()):  # in the order they run
        if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
            rate *= module.conv.stride[0]
        elif isinstance(module, Qwen3OmniMoeCausalConvNet):
            samples_back += (module.kernel_size - 1) / rate
    return frames + math.ceil(samples_back)


def frame_buckets(initial: int, chunk: int, left_context: int) -> list[int]:
    """Window lengths a stream decodes: powers of two up to the largest window, plus the exact first,
    steady and full-context sizes, so that most windows need no padding."""
    largest = chunk + left_context
    sizes = {initial, chunk, largest} | {1 << i for i in range(largest.bit_length()) if 1 << i < largest}
    return sorted(sizes)


def compiled_decoder(code2wav: torch.nn.Module) -> torch.nn.Module:
    """The whole vocoder through inductor (SnakeBeta, the transformer's glue and the GEMM formulation's
    overlap-adds fused), with dynamic shapes: one graph serves the (batch, frames) buckets (dynamo specialises
    sizes of 1, so those compile once more)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(code2wav, dynamic=True)


class Code2WavModel:
    def __init__(self, code2wav, device: torch.device, platform: Platform | None = None, enforce_eager: bool = True,
                 max_batch: int = 1, frame_sizes: list[int] | None = None, conv_backend: str = "native",
                 compile_step: bool = False):
        """`conv_backend` re-expresses the convolutions (`convolutions.py`); `compile_step` compiles the decoder
        (its compilation happens in the graphs' warm-ups, or on first use without graphs)."""
        self.code2wav = code2wav
        self.device = device
        self.num_quantizers = code2wav.config.num_quantizers
        self.samples_per_frame = int(code2wav.total_upsample)
        self.receptive_field_frames = receptive_field_frames(code2wav)
        use_conv_backend(code2wav, conv_backend)
        with torch.inference_mode():
            one = torch.zeros(1, self.num_quantizers, 1, dtype=torch.long, device=device)
            self.tail = self.samples_per_frame - code2wav(one).shape[-1]
        self.decoder = compiled_decoder(code2wav) if compile_step else code2wav
        self.cuda_graphs = CudaGraphCache("code2wav", self._decode_step,
                                          platform or Platform("cpu", "cpu", "gloo", False), not enforce_eager,
                                          batch_buckets(max_batch), frame_sizes or [], compile_step)

    @property
    def is_compiled(self) -> bool:
        return self.decoder is not self.code2wav

    def capture_cuda_graphs(self) -> None:
        """One graph per (batch bucket, frames bucket), with a progress bar; start-up logs their memory."""
        self.cuda_graphs.capture(lambda key: {"codes": torch.zeros(key[0], self.num_quantizers, key[1],
                                                                   dtype=torch.long, device=self.device)})

    def _decode_step(self, _frames, codes: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.decoder(codes)[:, 0],)

    @torch.inference_mode()
    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """Decode windows in one batch, right-padded with code 0 (harmless: the model is causal) to the
        graph bucket; returns each window's new float32 samples."""
        lengths = [len(w.codes) for w in windows]
        width = self.cuda_graphs.length_bucket(max(lengths)) or max(lengths)
        codes = torch.zeros(len(windows), width, self.num_quantizers, dtype=torch.long)
        for i, w in enumerate(windows):
            codes[i, : lengths[i]] = torch.tensor(w.codes)
        (wav,) = self.cuda_graphs.run(len(windows), width, {"codes": codes.transpose(1, 2).to(self.device)}, {})
        wav = wav.float().cpu().numpy()
        return [self.new_samples(w, row) for w, row in zip(windows, wav)]

    def new_samples(self, w: CodecWindow, wav: np.ndarray) -> np.ndarray:
        """The samples of a window's decoded waveform that are new: after its left context, less the tail that
        only the next window's frames complete."""
        end = len(w.codes) * self.samples_per_frame - self.tail
        start = 0 if w.is_first else w.num_context * self.samples_per_frame - self.tail
        return wav[start:end]

    def decode_full(self, codes: list[list[int]]) -> np.ndarray:
        """One-shot decode of a whole utterance (the reference for streaming)."""
        return self.decode([CodecWindow(codes, 0, True)])[0]
