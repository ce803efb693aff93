"""Qwen3-Omni Code2Wav as a batched stage model: windows of codec frames in, PCM out.

A window is [left context | new frames]. The vocoder is causal, so the output for the first T
frames of any decode is final except its last `tail` samples (the right-trim of the causal
transposed convolutions, 555 for the real upsample rates). Each chunk therefore starts `tail`
samples before its first new frame, re-emitting what the previous chunk withheld: consecutive
chunks join without the hole that transformers' `chunked_decode` leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True, frozen=True)
class CodecWindow:
    codes: list[list[int]]  # [frames][16], left context first
    num_context: int  # frames of left context at the front
    is_first: bool  # the request's first chunk: nothing withheld before it


class Code2WavModel:
    def __init__(self, code2wav, device: torch.device):
        self.code2wav = code2wav
        self.device = device
        self.samples_per_frame = int(code2wav.total_upsample)
        with torch.inference_mode():
            one = torch.zeros(1, code2wav.config.num_quantizers, 1, dtype=torch.long, device=device)
            self.tail = self.samples_per_frame - code2wav(one).shape[-1]

    @torch.inference_mode()
    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """Decode windows in one padded batch (right padding is harmless: the model is causal);
        returns each window's new float32 samples."""
        lengths = [len(w.codes) for w in windows]
        codes = torch.zeros(len(windows), max(lengths), self.code2wav.config.num_quantizers, dtype=torch.long)
        for i, w in enumerate(windows):
            codes[i, : lengths[i]] = torch.tensor(w.codes)
        wav = self.code2wav(codes.transpose(1, 2).to(self.device))[:, 0].float().cpu().numpy()
        out = []
        for i, w in enumerate(windows):
            end = lengths[i] * self.samples_per_frame - self.tail
            start = 0 if w.is_first else w.num_context * self.samples_per_frame - self.tail
            out.append(wav[i, start:end])
        return out

    @torch.inference_mode()
    def decode_full(self, codes: list[list[int]]) -> np.ndarray:
        """One-shot decode of a whole utterance (the reference for streaming)."""
        return self.decode([CodecWindow(codes, 0, True)])[0]
