"""WebRTC's audio on the server: the outgoing track (pacing, the session's audio sink) and the incoming
microphone's backlog (`MicBacklog`: old audio is dropped beyond a bound).

aiortc's RTP sender sends whatever `recv()` returns as fast as it returns it, so the track paces
itself: every `recv()` sleeps until `start + pts / 48000` on the wall clock and returns one 20 ms
frame, `pts` counted in samples (strictly increasing, no drift). The session writes the response's
PCM16 at the engine's rate (`write`); it is resampled to 48 kHz and queued in a bounded buffer (a full buffer
makes the writer wait). An empty buffer gives silence (a bench's microphone: its room, `fill`), so RTP keeps
flowing; while a response's audio is still owed that silence is an underrun. The track also knows what was really
sent (`played_ms`, the truncation point on barge-in) and reports playback on the data channel:
`output_audio_buffer.started` when a response's first audio goes out, `stopped` when it has all
gone out after the response is done (with the omnirt extension `omnirt_playback`:
{audio_ms, num_underruns}); `clear()` (barge-in) drops what is queued.

The microphone's frames wait in aiortc's receiver queue, which has no bound: a server that falls behind
would build a backlog and answer ever older speech. A call's reader task moves them at once into a
`MicBacklog` that holds at most `max_s` of audio; the session takes what is there when it is ready for
more, and what is older than that bound is dropped (counted, in /metrics and the log).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omnirt.app.audio.pcm import float_to_pcm16, pcm16_to_float
from omnirt.app.audio.resample import LowDelayResampler
from omnirt.app.audio.vad import VAD_RATE
from omnirt.app.audio.wire import PCM16
from omnirt.app.realtime.events import new_id

OPUS_RATE = 48000  # WebRTC's Opus clock
FRAME_SAMPLES = OPUS_RATE // 50  # 20 ms
UNDERRUN_FRAMES = 5  # a gap of 100 ms or more while audio is owed (docs/benchmarks.md, "Definitions")


def _zeros(num_samples: int) -> np.ndarray:
    return np.zeros(num_samples, np.int16)


class PacedAudioTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, on_event: Callable[[dict[str, Any]], None], max_buffer_s: float = 30.0,
                 input_rate: int = PCM16.sample_rate, fill: Callable[[int], np.ndarray] | None = None):
        super().__init__()
        self.on_event, self.input_rate = on_event, input_rate
        self._fill = fill or _zeros  # what an empty buffer plays (n samples at OPUS_RATE, int16): silence
        self.max_buffer_samples = int(max_buffer_s * OPUS_RATE)
        self._buf = np.zeros(0, np.int16)
        self._owners: deque[list] = deque()  # [response_id, item_id, samples]: whose samples are queued, in order
        self._played: dict[str, int] = {}  # item_id -> samples sent
        self._space = asyncio.Event()  # set whenever samples leave the buffer (or it is cleared)
        self._resampler = LowDelayResampler(input_rate, OPUS_RATE)
        self._writing: tuple[str, str] | None = None  # (response_id, item_id) being written
        self._dropped: set[str] = set()  # cleared responses: their late writes are ignored
        self._done: set[str] = set()  # responses with all their audio written
        self._playing: str | None = None  # the response whose audio is going out
        self._num_underrun_frames = self._num_underruns = self._num_response_samples = 0
        self._start: float | None = None
        self._pts = 0

    # ---- the session's AudioSink -------------------------------------------------------------------

    async def write(self, response_id: str, item_id: str, pcm16: bytes) -> None:
        if response_id in self._dropped or self.readyState != "live":
            return
        if self._writing != (response_id, item_id):
            self._finish_writing()
            self._writing = (response_id, item_id)
        pcm = np.frombuffer(float_to_pcm16(self._resampler(pcm16_to_float(pcm16))), np.int16)
        while pcm.size:
            while self._buf.size >= self.max_buffer_samples:
                self._space.clear()
                await self._space.wait()
                if self._writing != (response_id, item_id):  # cleared (barge-in) or stopped while waiting
                    return
            room = self.max_buffer_samples - self._buf.size
            self._push(response_id, item_id, pcm[:room])
            pcm = pcm[room:]

    def clear(self) -> None:
        if self._writing is not None:
            self._dropped.add(self._writing[0])
        self._writing = self._playing = None
        self._resampler = LowDelayResampler(self.input_rate, OPUS_RATE)
        self._buf = np.zeros(0, np.int16)
        self._owners.clear()
        self._space.set()

    def played_ms(self, item_id: str) -> int:
        return self._played.get(item_id, 0) * 1000 // OPUS_RATE

    # ---- from the transport ------------------------------------------------------------------------

    def response_done(self, response_id: str) -> None:
        """All of the response's audio was written (the session emitted `response.done`)."""
        if self._writing is not None and self._writing[0] == response_id:
            self._finish_writing()
        self._done = {response_id} | ({self._playing} & self._done)

    @property
    def num_buffered_samples(self) -> int:
        return self._buf.size

    def stop(self) -> None:
        super().stop()
        self.clear()

    # ---- aiortc's side -----------------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        else:
            await asyncio.sleep(max(0.0, self._start + self._pts / OPUS_RATE - time.monotonic()))
        frame = av.AudioFrame.from_ndarray(self._take(FRAME_SAMPLES)[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OPUS_RATE, self._pts, Fraction(1, OPUS_RATE)
        self._pts += FRAME_SAMPLES
        return frame

    # ---- the buffer ----------------------------------------------------------------------------------

    def _push(self, response_id: str, item_id: str, pcm: np.ndarray) -> None:
        if not pcm.size:
            return
        self._buf = np.concatenate([self._buf, pcm])
        if self._owners and self._owners[-1][:2] == [response_id, item_id]:
            self._owners[-1][2] += pcm.size
        else:
            self._owners.append([response_id, item_id, pcm.size])

    def _finish_writing(self) -> None:
        """The written response's resampler tail (a few ms) goes into the buffer; the next starts afresh."""
        if self._writing is not None:
            self._push(*self._writing, np.frombuffer(float_to_pcm16(self._resampler.flush()), np.int16))
            self._writing = None

    def _take(self, n: int) -> np.ndarray:
        out, self._buf = self._buf[:n], self._buf[n:]
        left = out.size
        while left:
            owner = self._owners[0]
            used = min(left, owner[2])
            self._started(owner[0])
            self._played[owner[1]] = self._played.get(owner[1], 0) + used
            owner[2], left = owner[2] - used, left - used
            if not owner[2]:
                self._owners.popleft()
        if out.size:
            self._space.set()
        self._after_frame(out.size)
        return out if out.size == n else np.concatenate([out, self._fill(n - out.size)])

    def _started(self, response_id: str) -> None:
        if response_id == self._playing:
            return
        if self._playing is not None:  # back to back with the previous response
            self._stopped()
        self._playing, self._num_underruns, self._num_underrun_frames, self._num_response_samples = response_id, 0, 0, 0
        self._emit("output_audio_buffer.started", response_id=response_id)

    def _after_frame(self, num_samples: int) -> None:
        """Playback bookkeeping: the end of a response's audio, or an underrun while it is still owed."""
        if self._playing is None:
            return
        self._num_response_samples += num_samples
        if self._buf.size:
            self._num_underrun_frames = 0
        elif self._playing in self._done:
            self._stopped()
        elif num_samples < FRAME_SAMPLES:
            self._num_underrun_frames += 1
            self._num_underruns += self._num_underrun_frames == UNDERRUN_FRAMES

    def _stopped(self) -> None:
        self._emit("output_audio_buffer.stopped", response_id=self._playing, omnirt_playback={
            "audio_ms": self._num_response_samples * 1000 // OPUS_RATE, "num_underruns": self._num_underruns})
        self._playing = None

    def _emit(self, kind: str, **fields: Any) -> None:
        self.on_event({"type": kind, "event_id": new_id("event"), **fields})


class MicBacklog:
    """Microphone audio (VAD_RATE mono float32) waiting for the session, bounded to the newest `max_s`:
    beyond that the oldest samples are dropped, so a session that falls behind skips audio instead of
    answering ever older speech. `close()` ends `take()`."""

    def __init__(self, max_s: float):
        self.max_samples = max(1, int(max_s * VAD_RATE))
        self._chunks: deque[np.ndarray] = deque()
        self._num_samples = 0
        self.num_dropped_samples = 0  # since the call began
        self._dropped_since_take = 0
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def num_samples(self) -> int:
        return self._num_samples

    def push(self, samples: np.ndarray) -> None:
        self._chunks.append(samples)
        self._num_samples += samples.size
        while self._num_samples > self.max_samples:
            over = self._num_samples - self.max_samples
            oldest = self._chunks[0]
            if oldest.size <= over:
                self._chunks.popleft()
                cut = oldest.size
            else:
                self._chunks[0], cut = oldest[over:], over
            self._num_samples -= cut
            self._dropped_since_take += cut
            self.num_dropped_samples += cut
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def take(self, min_samples: int) -> tuple[np.ndarray, int] | None:
        """Everything queued once at least `min_samples` are (all of it, at most `max_samples`), and the
        samples dropped since the last take; None once closed."""
        while self._num_samples < min_samples and not self._closed:
            self._ready.clear()
            await self._ready.wait()
        if self._closed:
            return None
        out = np.concatenate(self._chunks)
        dropped, self._dropped_since_take = self._dropped_since_take, 0
        self._chunks.clear()
        self._num_samples = 0
        return out, dropped
