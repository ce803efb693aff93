"""The audio encoder's windows: what makes the heard part of an utterance reusable before it ends.

Qwen3-Omni's audio encoder (transformers' `Qwen3OmniMoeAudioEncoder`) convolves each chunk of `2 * n_window` mel
frames alone, and its attention runs within windows of `n_window_infer` frames (`get_audio_cu_seqlens`; 800
frames, 8 s, 104 tokens in the released model). So a window's tokens depend on that window's frames and nothing
else, and a prompt's cache key carries one digest per window (not per audio): a prompt that holds the first k
windows of an utterance agrees with the whole utterance's prompt on those windows' positions, and the KV that a
speculative prefill wrote there while the user spoke is reused (`omnirt/pipeline/stage/prefix_cache.py`).

Exactness, measured on the CPU with the tiny model in fp32 (tests/test_stream_prefill.py):
- The encoder: a settled window's rows from a prompt that ends with it equal its rows in the whole utterance's
  encoding (bit for bit on the CPU; the test allows 1e-5, for kernels that round other shapes differently).
- The Thinker after a two-part prefill (the settled windows, then the rest): greedy tokens equal a whole
  prefill's, every step's logits within 1.2e-7 (of values up to 0.46: the prefill's chunks differ), and the
  spoken reply (every codebook of every frame, the PCM) is the same.
- The features (Whisper log-mel, `WhisperFeatureExtractor`) are not window-local, in two ways:
  1. each frame's STFT reaches `n_fft // 2 - hop` samples (40) past its end, so a window is settled only once
     that much audio after it was heard (`num_settled`);
  2. every value is clamped from below at the clip's global maximum less 8 (log10 units), then scaled by 1/4:
     a later, louder part raises the floor, and each value of the earlier windows moves by at most the rise of
     the (scaled) maximum: in the test, whose last second is 3x louder, 0.05% of the first two windows' values
     move, each by at most the rise, 0.13. Then that window's digest differs,
     the prefix match stops before it, and the request prefills it anew: the answer stays exact and only the
     speed-up is lost. Reuse therefore happens when the utterance's loudest frame lies in the part heard
     when the speculative prefill ran, which the test shows both ways.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnirt.pipeline.types import settled_windows


@dataclass(slots=True, frozen=True)
class AudioWindows:
    n_window: int  # half a convolution chunk, in mel frames
    n_window_infer: int  # an attention window, in mel frames
    hop_length: int  # input samples per mel frame
    n_fft: int  # samples an STFT frame spans

    def __post_init__(self):
        assert self.n_window_infer % (2 * self.n_window) == 0, "a window must hold whole convolution chunks"

    @property
    def window_samples(self) -> int:
        return self.n_window_infer * self.hop_length

    @property
    def lookahead_samples(self) -> int:
        """Samples past a frame's end that its STFT reads (centred frames, reflect padding at the clip's end)."""
        return max(0, self.n_fft // 2 - self.hop_length)

    def num_tokens(self, num_frames: int) -> int:
        return int(_get_feat_extract_output_lengths(num_frames, self.n_window))

    def token_counts(self, num_frames: int) -> list[int]:
        """The tokens of each window of an audio of `num_frames` frames (the last one may be short)."""
        full, rest = divmod(num_frames, self.n_window_infer)
        return [self.num_tokens(self.n_window_infer)] * full + ([self.num_tokens(rest)] if rest else [])

    def num_settled(self, num_samples: int) -> int:
        """Windows whose features no more audio changes (but for the clamp, see the module's docstring)."""
        return settled_windows(num_samples, self.window_samples, self.lookahead_samples)

    def digests(self, feats: torch.Tensor, num_frames: int) -> tuple[int, ...]:
        """A digest of each window's frames of an audio's features [mel, frames] (negative: never a token id)."""
        frames = feats[:, :num_frames].contiguous().numpy()
        return tuple(_digest(frames[:, s:s + self.n_window_infer])
                     for s in range(0, num_frames, self.n_window_infer))


def _digest(frames: np.ndarray) -> int:
    digest = hashlib.blake2b(np.ascontiguousarray(frames).tobytes(), digest_size=8, person=b"omnirt-audio")
    digest.update(np.int64(frames.shape[-1]).tobytes())
    return -1 - (int.from_bytes(digest.digest(), "little") >> 2)
