"""Hand-off between stages: what crosses a stage boundary, and when a chunk is ready.

Thinker -> Talker: per step only the new rows (prompt rows while prefilling, then one token
embedding per sampled token), plus a finished flag; never the whole history.
Talker -> Code2Wav: one frame of codes per step; `CodecStream` decides when a window is due:
a first chunk of `initial_codec_chunk_frames`, then chunks doubling in size up to `codec_chunk_frames`
(the ramp: at any RTF below 0.5 the listener's buffer never runs dry between chunks), the rest at
the end, each with up to `codec_left_context_frames` of left context.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import ConnectorConfig
from pipeline.models import CodecWindow


class Command(enum.Enum):
    ADD = "add"  # a new StageRequest
    INPUT = "input"  # a chunk from the upstream stage
    INPUTS = "inputs"  # one step's chunks for several requests: payload [(request_id, chunk), ...]
    INPUT_DONE = "input_done"  # the upstream stage finished this request
    ABORT = "abort"


@dataclass(slots=True, frozen=True)
class StageMessage:
    command: Command
    request_id: str
    payload: Any = None


@dataclass(slots=True)
class CodecStream:
    """The frames of one request on their way into Code2Wav."""

    initial_frames: int
    chunk_frames: int
    left_context_frames: int
    ramp: bool = False  # chunk k holds initial * 2**k frames (capped at chunk_frames): the buffer never runs dry
    frames: list[list[int]] = field(default_factory=list)
    num_emitted: int = 0
    num_chunks: int = 0
    input_done: bool = False
    wait_for_input: bool = False  # without async chunk: decode only once the Talker has finished

    @classmethod
    def from_config(cls, cfg: ConnectorConfig, initial_frames: int | None = None) -> CodecStream:
        return cls(initial_frames or cfg.initial_codec_chunk_frames, cfg.codec_chunk_frames,
                   cfg.codec_left_context_frames, ramp=cfg.codec_chunk_ramp)

    def _due(self) -> int:
        """Frames the next chunk needs before it may go (fewer once the input is done)."""
        if self.wait_for_input:
            return len(self.frames) - self.num_emitted
        if self.num_emitted == 0:
            return self.initial_frames
        if self.ramp:
            return min(self.chunk_frames, self.initial_frames << self.num_chunks)
        return self.chunk_frames

    def is_ready(self) -> bool:
        if self.wait_for_input and not self.input_done:
            return False
        pending = len(self.frames) - self.num_emitted
        return pending >= self._due() or (self.input_done and pending > 0)

    def is_drained(self) -> bool:
        return self.input_done and self.num_emitted == len(self.frames)

    def advance(self, num_frames: int) -> None:
        """The window from `next_window()` was decoded and emitted."""
        self.num_emitted += num_frames
        self.num_chunks += 1

    def next_window(self) -> tuple[CodecWindow, int]:
        """The window for the next chunk, and the frames it emits."""
        start = self.num_emitted
        end = min(len(self.frames), start + self._due())
        ctx = min(self.left_context_frames, start)
        return CodecWindow(self.frames[start - ctx:end], ctx, is_first=start == 0), end - start
