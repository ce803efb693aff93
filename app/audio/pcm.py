"""Audio containers: audio files in, WAV out, PCM16 bytes to and from float32 samples."""

from __future__ import annotations

import io
import wave

import numpy as np
import soundfile


class AudioFormatError(ValueError):
    pass


def decode_audio_file(data: bytes) -> tuple[np.ndarray, int]:
    """A WAV (or FLAC/OGG) file -> (float32 mono samples, sample rate)."""
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:
        raise AudioFormatError(f"not a readable audio file ({exc.__class__.__name__})") from exc
    if samples.size == 0:
        raise AudioFormatError("the audio file has no samples")
    return samples.mean(axis=1), int(rate)


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
    return np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
