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
# Sentences said in two parts with a pause between (`--speech paused`): the first part cannot end a turn (a
# continuation comma, words that need more), the second ends the sentence. Smart Turn v3.2 scores these first parts
# below 0.05 and the whole sentences, at every pause below, above 0.7 (espeak-ng 1.51).
PAUSED = (("So yesterday I went to the,", "market and bought some apples and a loaf of bread."),
          ("I would like to know,", "what the weather will be like in Paris tomorrow morning."))
PAUSES_S = (0.6, 0.7, 0.8, 0.9)


@functools.cache
def speech(rate: int, synthetic: bool = False, text: str = TEXT) -> np.ndarray:
    """Mono float32 speech at `rate` Hz (TEXT: about 2 s long); `synthetic`: the voiced signal even where espeak-ng
    is installed (what a machine without it sends)."""
    audio, src_rate = (None if synthetic else _espeak(text)) or _synthetic()
    return soxr.resample(audio.astype(np.float32), src_rate, rate) if rate != src_rate else audio


def paused_speech(rate: int, synthetic: bool = False) -> list[tuple[np.ndarray, float, float]]:
    """Each PAUSED sentence at each of PAUSES_S: (audio, where its pause starts in s, the pause in s). Synthetic: the
    voiced signal's two halves."""
    out = []
    for first, second in PAUSED:
        parts = [_trim(speech(rate, synthetic, t)) for t in (first, second)]
        if synthetic:
            whole = _trim(speech(rate, True))
            parts = [whole[:len(whole) // 2], whole[len(whole) // 2:]]
        for pause in PAUSES_S:
            out.append((np.concatenate([parts[0], np.zeros(int(pause * rate), np.float32), parts[1]]),
                        len(parts[0]) / rate, pause))
    return out


def _trim(audio: np.ndarray) -> np.ndarray:
    """From the first to the last sample above -34 dBFS: the speech alone."""
    loud = np.flatnonzero(np.abs(audio) > 0.02)
    return audio[loud[0]:loud[-1] + 1] if loud.size else audio


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def _espeak(text: str, voice: list[str] = ()) -> tuple[np.ndarray, int] | None:
    """espeak-ng saying `text` (`voice`: its -v/-s/-p options); None where espeak-ng is missing."""
    if shutil.which("espeak-ng") is None:
        return None
    import soundfile

    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", *voice, "-w", f.name, text], check=True, capture_output=True, timeout=30)
        audio, rate = soundfile.read(f.name, dtype="float32")
    return (audio if audio.ndim == 1 else audio.mean(1)), rate


def _synthetic(rate: int = 16000, seconds: float = 3.0) -> tuple[np.ndarray, int]:
    t = np.arange(int(rate * seconds)) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(pitch) / rate) / k for k in range(1, 8))
    syllables = 0.5 * (1 + np.sin(2 * np.pi * 4 * t)) ** 2  # ~4 syllables a second
    return (0.3 * voiced * syllables / np.abs(voiced).max()).astype(np.float32), rate
