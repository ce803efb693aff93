"""A session's input audio buffer: audio at any rate -> (noise reduction) -> one stream at the VAD's rate -> a
bounded buffer, with server or semantic VAD turning it into user turns (or the client committing it by hand).

The audio is resampled twice: the turns' audio (what the model hears) through libsoxr's high quality,
which holds back ~21 ms of 24 kHz input (~66 ms of 8 kHz G.711), and the VAD's view through its quick
quality, which holds back nothing, so that the end of a turn is not decided that much later. Both streams
count the same samples, so the VAD's positions index the buffer; a turn's end may lie past what the
buffer holds yet (the held-back tail of its trailing silence), and is cut there.

Positions are absolute samples of the session's stream at `VAD_RATE`, so `audio_start_ms` / `audio_end_ms`
count from the first audio of the session, as in OpenAI's events.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnirt.app.audio import denoise
from omnirt.app.audio.resample import StreamResampler
from omnirt.app.audio.vad import (
    VAD_RATE,
    PauseCandidate,
    SpeechStarted,
    SpeechStopped,
    TurnDetection,
    TurnDetector,
    VadBatcher,
    window_levels,
)


class BufferFull(Exception):
    pass


@dataclass(slots=True, frozen=True)
class TurnStarted:
    audio_start_ms: int


@dataclass(slots=True, frozen=True)
class TurnEnded:
    audio_end_ms: int
    audio: np.ndarray  # the turn at VAD_RATE, from the start (with prefix padding) to where the end was detected


TurnEvent = TurnStarted | TurnEnded


def _ms(sample: int) -> int:
    return sample * 1000 // VAD_RATE


class InputBuffer:
    """`vad` is the process's `VadBatcher` (shared by every session); `vad_config` the session's settings."""

    def __init__(self, max_buffer_s: float, vad_config: TurnDetection | None, vad: VadBatcher):
        self.vad = vad
        self.max_samples = int(max_buffer_s * VAD_RATE)
        self._resamplers: dict[tuple[int, str], StreamResampler] = {}  # by (input rate, quality)
        self._chunks: list[np.ndarray] = []
        self._start = self._end = 0  # absolute positions of the buffered samples
        self._vad_end = 0  # the VAD view's end: ahead of `_end` by what the high quality holds back
        self._turn_start: int | None = None
        self.detector: TurnDetector | None = None
        self.denoiser: denoise.Denoiser | None = None
        self.set_vad(vad_config)

    def set_vad(self, cfg: TurnDetection | None) -> None:
        """Turn detection on (fresh state), off (manual commit), or new settings (state kept)."""
        if cfg is not None and self.detector is not None:
            self.detector.cfg = cfg
            return
        self.detector = TurnDetector(cfg) if cfg is not None else None
        if self.detector is not None:
            self.detector.position = self._vad_end
        self._turn_start = None

    def set_noise_reduction(self, kind: str | None) -> None:
        """Noise reduction on ("near_field", "far_field": a fresh RNNoise stream) or off (None)."""
        self.denoiser = None if kind is None else denoise.Denoiser(kind)

    @property
    def num_samples(self) -> int:
        return self._end - self._start

    @property
    def duration_ms(self) -> int:
        return _ms(self.num_samples)

    @property
    def is_speaking(self) -> bool:
        return self._turn_start is not None

    @property
    def num_heard(self) -> int:
        """Samples of the turn in progress so far (0: none in progress)."""
        return 0 if self._turn_start is None else self._end - self._turn_start

    def heard(self) -> np.ndarray:
        """The turn in progress so far, from the start its `TurnEnded` audio will have (left in the buffer)."""
        return self._peek(self._turn_start, self._end)

    async def append(self, samples: np.ndarray, sample_rate: int) -> list[TurnEvent]:
        """Add audio; past the limit a turn in progress is ended there, otherwise BufferFull is raised
        (and none of the audio kept). One append at a time per session (the session's lock). With noise reduction
        on, the audio is denoised (at 48 kHz, batched with every session's, off the event loop) first."""
        if self.denoiser is not None:
            samples, sample_rate = await self.vad.denoise.denoise(self.denoiser, samples, sample_rate), denoise.RATE
        x, view = self._resample(samples, sample_rate, "HQ"), self._resample(samples, sample_rate, "QQ")
        events: list[TurnEvent] = []
        if self.num_samples + len(x) > self.max_samples:
            if self._turn_start is None or len(x) > self.max_samples:
                raise BufferFull(f"the input audio buffer holds at most {self.max_samples / VAD_RATE:.0f} s")
            # a turn longer than the buffer ends here; the VAD goes on listening for the next one
            events.append(TurnEnded(_ms(self._end), self._take(self._turn_start, self._end)))
            self._turn_start, self.detector.is_speaking = None, False
        self._chunks.append(x)
        self._end += len(x)
        self._vad_end += len(view)
        if self.detector is None:
            return events
        windows = self.detector.windows(view)
        if len(windows):  # a 20 ms chunk completes a 32 ms window, or none
            events += await self._detect(windows)
        if not self.is_speaking:  # keep only what a next turn's prefix padding may need
            self._drop_before(self._end - self.detector.cfg.prefix_padding_samples)
        return events

    async def _detect(self, windows: np.ndarray) -> list[TurnEvent]:
        """The turns that new VAD windows start or end (the model's calls batched with every session's)."""
        detector, levels, events = self.detector, window_levels(windows), []
        probs = await self.vad.probabilities(detector.stream, windows, levels, between_turns=not detector.is_speaking)
        for ev in detector.decide(windows, probs, levels):
            if isinstance(ev, PauseCandidate) and self._turn_start is not None:
                probability = await self.vad.turn_end.complete_probability(self._peek(self._turn_start, ev.at_sample))
                ev = detector.resolve(ev, probability)
            if isinstance(ev, SpeechStarted):
                self._turn_start = max(ev.start_sample, self._start)
                events.append(TurnStarted(_ms(self._turn_start)))
            elif isinstance(ev, SpeechStopped) and self._turn_start is not None:
                events.append(TurnEnded(_ms(ev.end_sample), self._take(self._turn_start, ev.commit_sample)))
                self._turn_start = None
        return events

    def commit(self) -> np.ndarray:
        """Everything buffered, for a manual commit; the buffer is empty afterwards."""
        audio = self._take(self._start, self._end)
        self._turn_start = None
        if self.detector is not None:
            self.detector.is_speaking = False
        return audio

    def clear(self) -> None:
        self.commit()

    def _resample(self, samples: np.ndarray, sample_rate: int, quality: str) -> np.ndarray:
        key = (sample_rate, quality)
        if key not in self._resamplers:
            self._resamplers[key] = StreamResampler(sample_rate, VAD_RATE, quality)
        return self._resamplers[key](samples)

    def _take(self, start: int, end: int) -> np.ndarray:
        end = min(end, self._end)
        audio = self._peek(start, end)
        self._chunks = [self._chunks[0][end - self._start:]]
        self._start = end
        return audio

    def _peek(self, start: int, end: int) -> np.ndarray:
        """The buffered audio from `start` to `end`, left in the buffer (as one chunk from now on)."""
        end = min(end, self._end)  # a VAD position past what the high quality has delivered yet
        self._chunks = [np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)]
        return self._chunks[0][start - self._start:end - self._start]

    def _drop_before(self, position: int) -> None:
        """Forget the audio before `position`: whole chunks, then the head of the first (no copy of the rest)."""
        position = min(position, self._end)
        while self._chunks and self._start + len(self._chunks[0]) <= position:
            self._start += len(self._chunks.pop(0))
        if position > self._start:
            self._chunks[0], self._start = self._chunks[0][position - self._start:], position
