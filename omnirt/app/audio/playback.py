"""The client's playback clock, shared by the server's metrics and the load tests: playback starts
with the first audio packet and stalls whenever the audio received so far has all been played.
An underrun is a stall of at least `UNDERRUN_S` while the response still owes audio (the definitions of
docs/benchmarks.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

UNDERRUN_S = 0.100


def pcm16_seconds(pcm16: bytes, sample_rate: int) -> float:
    return len(pcm16) / 2 / sample_rate


@dataclass(slots=True)
class PlaybackClock:
    num_packets: int = 0
    audio_s: float = 0.0
    first_at: float | None = None
    last_at: float | None = None
    played_until: float = 0.0  # wall time at which the audio received so far runs out
    num_underruns: int = 0
    gaps_s: list[float] = field(default_factory=list)
    stalls_s: list[float] = field(default_factory=list)

    def on_packet(self, at: float, duration_s: float) -> float:
        """Record a packet arriving at `at`; returns the stall it ended (0 if playback never ran dry)."""
        stall = 0.0
        if self.first_at is None:
            self.first_at, self.played_until = at, at
        else:
            self.gaps_s.append(at - self.last_at)
            stall = max(0.0, at - self.played_until)
            if stall > 0:
                self.stalls_s.append(stall)
                self.num_underruns += stall >= UNDERRUN_S
        self.played_until = max(self.played_until, at) + duration_s
        self.num_packets += 1
        self.audio_s += duration_s
        self.last_at = at
        return stall
