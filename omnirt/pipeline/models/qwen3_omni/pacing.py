"""When a request's next Code2Wav chunk goes, and how many frames it takes (`codec_stream.CodecStream` asks).

The listener starts playing at the first packet and then drains one frame of audio (`frame_s`) per frame.
A chunk decoded too late leaves it silent (an underrun); a chunk sent early is small, and every chunk
re-decodes its left context, so small chunks cost Code2Wav throughput. Two policies:

- `FixedChunks`: `initial_frames`, then `max_frames` per chunk, or with `ramp` a doubling ramp up to it
  (the buffer never runs dry while the Talker runs at RTF below 0.5, and does when it is slower).
- `AdaptivePacing`: measures this request's Talker pace (seconds between frames) and sends each chunk as
  late as is safe: once waiting for one more frame would leave the listener less than `margin_s` plus
  two decode times of audio (one step that may be running when the chunk falls due, and its own). The
  first chunk goes at `initial_frames` when the pace keeps ahead of playback, and otherwise waits for
  enough lead that playback survives `max_frames` more frames at the measured pace. So a fast Talker
  gets growing chunks (fewer re-decoded contexts) and a slow start gets a later, longer first chunk
  instead of a stall.
Both take simulated times (`now`, seconds): the tests drive them with paces, not wall clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GAP_WEIGHT = 0.3  # weight of the newest gap between frames in the pace's moving average


@dataclass(slots=True)
class FixedChunks:
    initial_frames: int
    max_frames: int
    ramp: bool = False
    num_chunks: int = 0

    def on_frame(self, now: float) -> None:
        """A frame arrived (the fixed sizes do not look at the pace)."""

    def frames_to_send(self, now: float, lead_s: float | None, num_pending: int, input_done: bool) -> int:
        """Frames the chunk takes if it goes now; 0: wait."""
        if self.num_chunks == 0:
            due = self.initial_frames
        else:
            due = min(self.max_frames, self.initial_frames << self.num_chunks) if self.ramp else self.max_frames
        return min(due, num_pending) if num_pending >= due or (input_done and num_pending) else 0

    def on_sent(self, decided_at: float, now: float, num_frames: int) -> None:
        self.num_chunks += 1

    def describe(self) -> str:
        return "fixed pacing, ramp" if self.ramp else "fixed pacing"


@dataclass(slots=True)
class AdaptivePacing:
    initial_frames: int
    max_frames: int
    frame_s: float  # seconds of audio per frame
    margin_s: float  # audio the listener keeps queued when a chunk is decided, beyond the decode times
    gap_s: float | None = None  # moving average of the seconds between this request's frames
    last_gap_s: float = 0.0
    last_frame_at: float | None = None
    decode_s: float = 0.0  # the longest a chunk of this request took from its decision to its emission
    num_chunks: int = 0
    reasons: list[str] = field(default_factory=list)  # why each chunk went (logged at the end)

    def on_frame(self, now: float) -> None:
        if self.last_frame_at is not None:
            self.last_gap_s = now - self.last_frame_at
            g = self.gap_s
            self.gap_s = self.last_gap_s if g is None else g + GAP_WEIGHT * (self.last_gap_s - g)
        self.last_frame_at = now

    def frames_to_send(self, now: float, lead_s: float | None, num_pending: int, input_done: bool) -> int:
        """Frames the chunk takes if it goes now (0: wait). `lead_s`: audio the listener still has queued,
        None before the first chunk."""
        if num_pending == 0:
            return 0
        # a request may ask for a first chunk larger than the steady one (its initial_codec_chunk_frames)
        cap = self.max_frames if lead_s is not None else max(self.max_frames, self.initial_frames)
        take = min(num_pending, cap)
        if input_done:
            return self._go(take, "end")
        if num_pending >= cap:
            return self._go(take, "full")
        if lead_s is None:
            ok = num_pending >= self.initial_frames and self._first_lead_holds(num_pending)
            return self._go(take, "first") if ok else 0
        if lead_s - self._next_gap_s() < self._reserve_s():
            return self._go(take, "due")
        return 0

    def on_sent(self, decided_at: float, now: float, num_frames: int) -> None:
        self.decode_s = max(self.decode_s, now - decided_at)
        self.num_chunks += 1

    def describe(self) -> str:
        """The decisions, for the log line at a reply's end."""
        return f"adaptive pacing: {','.join(self.reasons)}; pace {self.gap_s or 0:.3f} s/frame"

    def _go(self, n: int, reason: str) -> int:
        self.reasons[self.num_chunks:] = [reason]  # asked again before the chunk went: the newest decision stands
        return n

    def _reserve_s(self) -> float:
        return self.margin_s + 2 * self.decode_s

    def _next_gap_s(self) -> float:
        """A cautious wait for the next frame: the slower of the average and the last gap."""
        return max(self.gap_s or 0.0, self.last_gap_s)

    def _first_lead_holds(self, num_pending: int) -> bool:
        """Would a first chunk of `num_pending` frames keep playback fed for `max_frames` more frames at the
        measured pace? Frame i after it arrives i gaps from now and is due (num_pending + i - 1) frames of
        audio from now; the worst i is the first when the pace is ahead of playback, else the last."""
        if self.gap_s is None:  # one frame so far: no pace yet
            return True
        gap, reserve = self._next_gap_s(), self._reserve_s()
        return all(i * gap <= (num_pending + i - 1) * self.frame_s - reserve for i in (1, self.max_frames))
