"""One response's audio as a client hears it, reported through Locust's request event: time to first
audio, end-to-end latency, every gap between packets, and underruns (playback stalls >= 100 ms while
audio was still owed, per docs/benchmarks.md's definitions, using the server's own PlaybackClock definition)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from omnirt.app.audio.playback import UNDERRUN_S, PlaybackClock, pcm16_seconds
from omnirt.app.audio.wire import PCM16

METRIC_TYPE = "audio"


@dataclass
class AudioTrace:
    """Times are time.perf_counter() seconds; `started` is when the request (or turn end) happened."""

    started: float
    clock: PlaybackClock = field(default_factory=PlaybackClock)
    num_bytes: int = 0

    def on_audio(self, pcm16: bytes) -> None:
        self.clock.on_packet(time.perf_counter(), pcm16_seconds(pcm16, PCM16.sample_rate))
        self.num_bytes += len(pcm16)

    def report(self, environment, prefix: str, ended: float | None = None,
               first_audio_name: str = "time_to_first_audio") -> None:
        c = self.clock
        if c.first_at is None:
            return

        def emit(name: str, ms: float, length: int = 0) -> None:
            environment.events.request.fire(request_type=METRIC_TYPE, name=f"{prefix} {name}", response_time=ms,
                                            response_length=length, exception=None, context={})

        emit(first_audio_name, _ms(c.first_at - self.started), self.num_bytes)
        if ended is not None:
            emit("end_to_end", _ms(ended - self.started), self.num_bytes)
            emit("rtf_x1000", 1000 * (c.last_at - self.started) / max(c.audio_s, 1e-6))
        for gap in c.gaps_s:
            emit("audio_gap", _ms(gap))
        for stall in c.stalls_s:
            if stall >= UNDERRUN_S:
                emit("underrun", _ms(stall))


def _ms(seconds: float) -> float:
    return seconds * 1000.0
