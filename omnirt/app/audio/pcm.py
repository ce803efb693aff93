"""PCM16 bytes to and from float32 samples, and the WAV container (compressed files: `omnirt/app/audio/files.py`)."""

from __future__ import annotations

import io
import wave

import numpy as np


class AudioFormatError(ValueError):
    pass


def encode_wav(pcm16: bytes, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16)
    return buf.getvalue()


def pcm16_to_float(pcm16: bytes) -> np.ndarray:
    if len(pcm16) % 2:
        raise AudioFormatError("PCM16 audio must have an even number of bytes")
    return np.multiply(np.frombuffer(pcm16, dtype="<i2"), 1 / 32768, dtype=np.float32)  # one array, not two


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
