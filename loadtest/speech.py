"""The spoken input the load users send: an espeak-ng utterance when espeak-ng is installed (`make
sysdeps`), else a voiced, syllable-modulated signal that an energy or Silero VAD also takes for speech.
Built once per process, at the rates the protocols need."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile

import numpy as np
import soxr

TEXT = "What is the weather like in Paris today"  # one phrase: no pause for the VAD to end the turn early


@functools.cache
def speech(rate: int, synthetic: bool = False) -> np.ndarray:
    """Mono float32 speech at `rate` Hz, about 2 s long; `synthetic`: the voiced signal even where espeak-ng is
    installed (what a machine without it sends)."""
    audio, src_rate = (None if synthetic else _espeak()) or _synthetic()
    return soxr.resample(audio.astype(np.float32), src_rate, rate) if rate != src_rate else audio


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def _espeak() -> tuple[np.ndarray, int] | None:
    if shutil.which("espeak-ng") is None:
        return None
    import soundfile

    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-w", f.name, TEXT], check=True, capture_output=True, timeout=30)
        audio, rate = soundfile.read(f.name, dtype="float32")
    return (audio if audio.ndim == 1 else audio.mean(1)), rate


def _synthetic(rate: int = 16000, seconds: float = 3.0) -> tuple[np.ndarray, int]:
    t = np.arange(int(rate * seconds)) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(pitch) / rate) / k for k in range(1, 8))
    syllables = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2  # ~4 syllables a second
    return (0.3 * voiced * syllables / np.abs(voiced).max()).astype(np.float32), rate
