"""Talker -> Code2Wav: the frames of one request on their way into the vocoder.

The Talker hands Code2Wav one frame of 16 codes per step; `CodecStream` holds them and cuts windows, each with
up to `codec_left_context_frames` of left context; its pacing (`pacing.py`: fixed sizes, the doubling ramp, or
adaptive to the Talker's measured pace) says when the next chunk goes and how many frames it takes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnirt.pipeline.config import ConnectorConfig
from omnirt.pipeline.models.qwen3_omni.code2wav import CodecWindow
from omnirt.pipeline.models.qwen3_omni.pacing import AdaptivePacing, FixedChunks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CodecStream:
    """The frames of one request on their way into Code2Wav; `pacing` decides when each chunk goes."""

    left_context_frames: int
    pacing: FixedChunks | AdaptivePacing
    frame_s: float = 0.08  # seconds of audio per frame
    name: str = ""  # the request, for the log line at its end
    frames: list[list[int]] = field(default_factory=list)
    num_emitted: int = 0
    input_done: bool = False
    wait_for_input: bool = False  # without async chunk: decode only once the Talker has finished
    clock: Callable[[], float] = time.monotonic
    started_at: float | None = None  # when the first chunk was decided: the listener's playback starts then
    min_lead_s: float | None = None  # the least audio the listener had queued when a later chunk was decided
    chunk_sizes: list[int] = field(default_factory=list)
    _next: int = 0  # frames of the chunk decided by the last `is_ready()` (0: none decided)
    _decided_at: float = 0.0

    @classmethod
    def from_config(cls, cfg: ConnectorConfig, frame_s: float, initial_frames: int | None = None,
                    name: str = "") -> CodecStream:
        initial = initial_frames or cfg.initial_codec_chunk_frames
        if cfg.codec_chunk_pacing == "adaptive":
            pacing = AdaptivePacing(initial, cfg.codec_chunk_frames, frame_s, cfg.codec_chunk_margin_ms / 1000)
        else:
            pacing = FixedChunks(initial, cfg.codec_chunk_frames, cfg.codec_chunk_ramp)
        return cls(cfg.codec_left_context_frames, pacing, frame_s, name)

    @classmethod
    def fixed(cls, initial_frames: int, chunk_frames: int, left_context_frames: int, ramp: bool = False,
              **kwargs: Any) -> CodecStream:
        return cls(left_context_frames, FixedChunks(initial_frames, chunk_frames, ramp), **kwargs)

    def add(self, frame: list[int]) -> None:
        """A frame from the Talker."""
        self.frames.append(frame)
        self.pacing.on_frame(self.clock())

    def _lead_s(self, now: float) -> float | None:
        """Audio the listener still has queued (it plays from the first chunk on); None before it."""
        return None if self.started_at is None else self.started_at + self.num_emitted * self.frame_s - now

    def _decide(self) -> int:
        now, pending = self.clock(), len(self.frames) - self.num_emitted
        if self.wait_for_input:
            n = pending if self.input_done else 0
        else:
            n = self.pacing.frames_to_send(now, self._lead_s(now), pending, self.input_done)
        self._next, self._decided_at = n, now
        return n

    def is_ready(self) -> bool:
        return self._decide() > 0

    def is_drained(self) -> bool:
        return self.input_done and self.num_emitted == len(self.frames)

    def advance(self, num_frames: int) -> None:
        """The window from `next_window()` was decoded and emitted."""
        lead = self._lead_s(self._decided_at)
        if lead is None:
            self.started_at = self._decided_at
        else:
            self.min_lead_s = lead if self.min_lead_s is None else min(self.min_lead_s, lead)
        self.pacing.on_sent(self._decided_at, self.clock(), num_frames)
        self.num_emitted += num_frames
        self.chunk_sizes.append(num_frames)
        self._next = 0
        if self.is_drained():
            self._log_end()

    def next_window(self) -> tuple[CodecWindow, int]:
        """The window for the next chunk, and the frames it emits."""
        start = self.num_emitted
        end = start + (self._next or self._decide())
        ctx = min(self.left_context_frames, start)
        return CodecWindow(self.frames[start - ctx:end], ctx, is_first=start == 0), end - start

    def _log_end(self) -> None:
        lead = "-" if self.min_lead_s is None else f"{self.min_lead_s * 1000:.0f} ms"
        log.info("code2wav %s: %d frames in chunks of %s (%s); least audio queued at a chunk: %s", self.name,
                 self.num_emitted, ",".join(map(str, self.chunk_sizes)), self.pacing.describe(), lead)
