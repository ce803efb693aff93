"""Input noise reduction (`noise_reduction: {"type": "near_field" | "far_field"}`): RNNoise (xiph's recurrent
suppressor, through the `pyrnnoise` wheel's own `librnnoise`), streaming per session, before the VAD and the model.

RNNoise works on 10 ms frames of 48 kHz audio (480 samples), so each session's input is brought to 48 kHz
(libsoxr's quick quality: it holds nothing back), denoised a frame at a time with the session's own recurrent
state, and handed on to the input buffer's resamplers as 48 kHz audio. RNNoise's output trails its input by two
frames (960 samples, 20 ms); those are dropped at the start, so that sample positions (and `audio_start_ms`) stay
those of the input and the stream holds back 20-30 ms.

The two settings, as OpenAI names them: `near_field` (a headset or phone at the mouth: speech far above the noise)
takes RNNoise's output as it is; `far_field` (a laptop or room microphone: quieter, reverberant speech, which a
full-strength suppressor starts to eat) mixes `FAR_FIELD_DRY` of the original back in, so that it never takes
away more than ~14 dB and keeps the quiet, distant parts of the voice.

Cost (docs/realtime.md): ~0.9 ms of a CPU core per 20 ms chunk on the 2-core test machine, 4-5 % of a core per
session while audio flows (the wheel's librnnoise is a plain x86-64 build, without AVX). Far too much for the event
loop: `DenoiseBatcher` takes every session's chunks of a round off the loop, and spreads them over up to
`MAX_THREADS` threads (RNNoise's C code runs without the GIL; each session's chunks stay in order, one at a time).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from omnirt.app.audio.resample import StreamResampler
from omnirt.app.audio.rounds import Rounds

NOISE_REDUCTIONS = ("near_field", "far_field")
RATE = 48000
FRAME = 480
DELAY = 2 * FRAME  # RNNoise's output lags its input by this many samples
FAR_FIELD_DRY = 0.2  # the share of the original that far_field keeps (at most 20*log10(1/0.2) = 14 dB less noise)
MAX_THREADS = 4  # the denoising threads of a process (at most its CPU count)
_SCALE = 32768.0  # RNNoise takes 16-bit sample values as floats
_P = ctypes.POINTER(ctypes.c_float)


class Denoiser:
    """One session's RNNoise stream: audio at any rate in, the denoised audio at 48 kHz out, positions kept."""

    def __init__(self, kind: str):
        from pyrnnoise import rnnoise  # loads librnnoise (and pyrnnoise's own imports, ~0.25 s) on first use

        assert kind in NOISE_REDUCTIONS
        self._lib, self._state = rnnoise.lib, rnnoise.create()
        self._destroy = rnnoise.destroy
        self.dry = FAR_FIELD_DRY if kind == "far_field" else 0.0
        self._resamplers: dict[int, StreamResampler] = {}
        self._pending = np.zeros(0, np.float32)  # 48 kHz input short of a whole frame
        self._history = np.zeros(DELAY, np.float32)  # input aligned with the frames RNNoise gives back now
        self._to_skip = DELAY  # output before the first input sample
        self._out = np.empty(FRAME, np.float32)

    def __del__(self):
        if getattr(self, "_state", None) is not None:
            self._destroy(self._state)

    def __call__(self, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        if sample_rate not in self._resamplers:
            self._resamplers[sample_rate] = StreamResampler(sample_rate, RATE, "QQ")
        x = np.concatenate([self._pending, self._resamplers[sample_rate](samples)])
        n = len(x) // FRAME * FRAME
        self._pending = x[n:]
        frames = [self._frame(x[i:i + FRAME]) for i in range(0, n, FRAME)]
        out = np.concatenate(frames) if frames else np.zeros(0, np.float32)
        skip = min(self._to_skip, len(out))
        self._to_skip -= skip
        return out[skip:]

    def _frame(self, x: np.ndarray) -> np.ndarray:
        frame = np.ascontiguousarray(x * _SCALE, np.float32)
        self._lib.rnnoise_process_frame(self._state, self._out.ctypes.data_as(_P), frame.ctypes.data_as(_P))
        y = self._out / _SCALE
        if self.dry:
            y = (1.0 - self.dry) * y + self.dry * self._history[:FRAME]
        self._history = np.concatenate([self._history[FRAME:], x])
        return y.astype(np.float32)


class _Job:
    __slots__ = ("denoiser", "samples", "sample_rate", "out")

    def __init__(self, denoiser: Denoiser, samples: np.ndarray, sample_rate: int):
        self.denoiser, self.samples, self.sample_rate, self.out = denoiser, samples, sample_rate, None

    def is_pending(self) -> bool:
        return self.out is None

    def result(self) -> np.ndarray:
        return self.out


class DenoiseBatcher:
    """The process's noise reduction: `await denoise(denoiser, samples, rate)` from any session; one hop off the
    event loop per round for every session's chunks, spread over the denoising threads."""

    def __init__(self, num_threads: int = min(MAX_THREADS, os.cpu_count() or 1)):
        self._rounds = Rounds(self._round, "omnirt-denoise")
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="omnirt-rnnoise") if num_threads > 1 else None
        self.num_chunks = 0

    async def denoise(self, denoiser: Denoiser, samples: np.ndarray, sample_rate: int) -> np.ndarray:
        return await self._rounds.submit(_Job(denoiser, samples, sample_rate))

    def _round(self, jobs: list[_Job]) -> None:
        outs = map(_run, jobs) if self._pool is None or len(jobs) == 1 else self._pool.map(_run, jobs)
        for job, out in zip(jobs, list(outs)):
            job.out = out
        self.num_chunks += len(jobs)


def _run(job: _Job) -> np.ndarray:
    return job.denoiser(job.samples, job.sample_rate)
