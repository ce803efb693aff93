"""Resampling: a whole clip, and two streaming resamplers whose chunked output equals resampling the whole
stream: libsoxr for input audio (cheap per chunk; ~20 ms buffered at its high quality, none at its quick
one), polyphase for output audio (~1 ms delay)."""

from __future__ import annotations

from math import ceil, gcd

import numpy as np
import soxr
from scipy.signal import resample_poly


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """A whole clip through libsoxr (anti-aliased; what `StreamResampler` gives for the same stream in
    chunks); a no-op when the rates agree."""
    if from_rate == to_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    return soxr.resample(samples.astype(np.float32, copy=False), from_rate, to_rate)


class StreamResampler:
    """Resampling of input audio that arrives in chunks of any size, through libsoxr (`soxr`): every 20 ms
    of every session's microphone, so the cost per chunk matters.

    Resampling each chunk on its own would taper both ends of every chunk (the filter sees zeros
    there): a periodic click the VAD and the Thinker would hear. soxr keeps its filter state across
    chunks, so the output equals the one-shot resampling of the whole stream, bit for bit, at ~10 µs
    per 20 ms chunk (scipy's `resample_poly` designed its filter again on every call: ~300 µs). The
    price is soxr's buffering: at its default high quality (`"HQ"`) the output trails the input by ~21 ms
    (24 or 48 kHz in) to ~66 ms (8 kHz in); its quick quality (`"QQ"`: cubic interpolation, no
    anti-aliasing filter) holds back nothing, for a view of the audio that must be current rather than
    clean (the VAD's).
    """

    def __init__(self, from_rate: int, to_rate: int, quality: str = "HQ"):
        self.from_rate, self.to_rate = from_rate, to_rate
        self._stream = (None if self.is_identity else
                        soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality=quality))

    @property
    def is_identity(self) -> bool:
        return self.from_rate == self.to_rate

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        samples = samples.astype(np.float32, copy=False)
        return samples if self._stream is None else self._stream.resample_chunk(samples)

    def flush(self) -> np.ndarray:
        """The held-back tail (end of stream); the stream starts afresh."""
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        self._stream.clear()
        return tail


class LowDelayResampler:
    """Polyphase resampling of a stream in chunks, delayed by about a millisecond: for the output audio
    (24 kHz speech -> 48 kHz WebRTC, 8 kHz G.711), a few chunks a second per response, where first-audio
    latency and exact sample counts (played positions, truncation) matter more than the cost per chunk.

    Resampling each chunk on its own would taper both ends of every chunk (a periodic click). This keeps
    `margin` input samples of left context and holds back `margin` of look-ahead, both multiples of the
    decimation step, so the output equals `resample_poly` of the whole stream (delayed by about a
    millisecond). scipy designs its filter on every call (~300 µs): fine at a few chunks a second.
    """

    def __init__(self, from_rate: int, to_rate: int):
        g = gcd(from_rate, to_rate)
        self.up, self.down = to_rate // g, from_rate // g
        half_width = ceil(10 * max(self.up, self.down) / self.up) + 1  # resample_poly's default filter
        self.margin = ceil(half_width / self.down) * self.down
        self._buf = np.zeros(self.margin, dtype=np.float32)

    @property
    def is_identity(self) -> bool:
        return self.up == self.down

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        if self.is_identity:
            return samples.astype(np.float32, copy=False)
        buf = np.concatenate([self._buf, samples.astype(np.float32, copy=False)])
        m = self.margin
        end = m + (len(buf) - 2 * m) // self.down * self.down  # last input position with full look-ahead
        if end <= m:
            self._buf = buf
            return np.zeros(0, dtype=np.float32)
        out = resample_poly(buf[:end + m], self.up, self.down)[m * self.up // self.down:end * self.up // self.down]
        self._buf = buf[end - m:]
        return out.astype(np.float32)

    def flush(self) -> np.ndarray:
        """The held-back tail (end of stream: zeros assumed after it); the stream starts afresh."""
        if self.is_identity:
            return np.zeros(0, dtype=np.float32)
        m, pending = self.margin, len(self._buf) - self.margin
        start = m * self.up // self.down
        out = resample_poly(np.concatenate([self._buf, np.zeros(m, np.float32)]), self.up, self.down)
        self._buf = np.zeros(m, dtype=np.float32)
        return out[start:start + ceil(pending * self.up / self.down)].astype(np.float32)
