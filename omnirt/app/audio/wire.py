"""Realtime wire audio: the three formats (PCM16 24 kHz, G.711 mu-law / A-law 8 kHz) to and from
float32 samples. `PCM16.sample_rate` is the one definition of the protocols' 24 kHz.

G.711 is done with numpy tables (the ITU-T segment rules, as in the old `audioop` module, which
Python 3.13 removed); the tests check every 16-bit value against `audioop` where it still exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnirt.app.audio.pcm import AudioFormatError, float_to_pcm16, pcm16_to_float


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
