"""Realtime wire audio: the three formats (PCM16 24 kHz, G.711 mu-law / A-law 8 kHz) to and from
float32 samples, and two streaming resamplers whose chunked output equals resampling the whole stream: libsoxr
for input audio (cheap per chunk, ~20 ms buffered), polyphase for output audio (~1 ms delay).

G.711 is done with numpy tables (the ITU-T segment rules, as in the old `audioop` module, which
Python 3.13 removed); the tests check every 16-bit value against `audioop` where it still exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, gcd

import numpy as np
import soxr
from scipy.signal import resample_poly

from app.audio import AudioFormatError, float_to_pcm16, pcm16_to_float


@dataclass(slots=True, frozen=True)
class AudioFormat:
    name: str  # the beta name, also used internally
    mime: str  # the GA `{"type": ...}`
    sample_rate: int


PCM16 = AudioFormat("pcm16", "audio/pcm", 24000)
G711_ULAW = AudioFormat("g711_ulaw", "audio/pcmu", 8000)
G711_ALAW = AudioFormat("g711_alaw", "audio/pcma", 8000)
FORMATS = {f.name: f for f in (PCM16, G711_ULAW, G711_ALAW)}
FORMATS_BY_MIME = {f.mime: f for f in FORMATS.values()}


# ---- G.711 ------------------------------------------------------------------------------------------

_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 2  # 14-bit
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), 8159) + 0x21
    seg = np.searchsorted(_ULAW_SEG_END, mag)
    val = (seg << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0xF)
    return (np.where(seg >= 8, 0x7F, val) ^ mask).astype(np.uint8)


def _alaw_encode_table() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 3  # 13-bit
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = np.searchsorted(_ALAW_SEG_END, mag)
    quant = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0xF
    return (np.where(seg >= 8, 0x7F, (seg << 4) | quant) ^ mask).astype(np.uint8)


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0xF) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    seg = (a & 0x70) >> 4
    t = ((a & 0xF) << 4) + np.where(seg == 0, 8, 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ENCODE = {"g711_ulaw": _ulaw_encode_table(), "g711_alaw": _alaw_encode_table()}
_DECODE = {"g711_ulaw": _ulaw_decode_table(), "g711_alaw": _alaw_decode_table()}


def decode(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes -> float32 samples at `fmt.sample_rate`."""
    if fmt is PCM16:
        if len(data) % 2:
            raise AudioFormatError("pcm16 audio must have an even number of bytes (16-bit little-endian samples)")
        return pcm16_to_float(data)
    return _DECODE[fmt.name][np.frombuffer(data, dtype=np.uint8)].astype(np.float32) / 32768.0


def encode(samples: np.ndarray, fmt: AudioFormat) -> bytes:
    """float32 samples at `fmt.sample_rate` -> wire bytes."""
    pcm = float_to_pcm16(samples)
    if fmt is PCM16:
        return pcm
    return _ENCODE[fmt.name][np.frombuffer(pcm, dtype="<i2").astype(np.int64) + 32768].tobytes()


# ---- streaming resampler ------------------------------------------------------------------------------


class StreamResampler:
    """Resampling of input audio that arrives in chunks of any size, through libsoxr (`soxr`): every 20 ms
    of every session's microphone, so the cost per chunk matters.

    Resampling each chunk on its own would taper both ends of every chunk (the filter sees zeros
    there): a periodic click the VAD and the Thinker would hear. soxr keeps its filter state across
    chunks, so the output equals the one-shot resampling of the whole stream, bit for bit, at ~10 µs
    per 20 ms chunk (scipy's `resample_poly` designed its filter again on every call: ~300 µs). The
    price is soxr's buffering: at its default (high) quality the output trails the input by ~24 ms
    (24 or 48 kHz in) to ~58 ms (8 kHz in).
    """

    def __init__(self, from_rate: int, to_rate: int):
        self.from_rate, self.to_rate = from_rate, to_rate
        self._stream = None if self.is_identity else soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32")

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
