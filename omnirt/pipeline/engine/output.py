"""Async output: each request's reply stream, filled from stage threads and read on the event loop.

Stage threads hand only typed raw results (`TextTokens`, `AudioPcm`) to the event loop and never wait for it;
the engine ends each stream with a `Finished`. Detokenisation and event shaping happen on the reading side. The
queue is bounded in bytes: a consumer that stops reading gets its request aborted (`on_overflow`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from omnirt.pipeline.stage.graph import AudioPcm, TextTokens
from omnirt.pipeline.types import Finished, OmniRequest

ReplyItem = TextTokens | AudioPcm | Finished


@dataclass(slots=True)
class ReplyStream:
    """Engine-side record of one request: what its reply has counted so far, and the queue of its items."""

    request: OmniRequest
    loop: asyncio.AbstractEventLoop
    num_prompt_tokens: int
    stages: tuple[str, ...]  # the stages it was admitted to
    max_buffered_bytes: int
    on_overflow: Callable[[ReplyStream], None]  # called on the event loop once the bound is crossed
    truncated_messages: int = 0  # leading conversation messages the prompt left out
    submitted_at: float = 0.0  # time.perf_counter() when the engine got it (omnirt/pipeline/engine/timeline.py)
    queue: asyncio.Queue[ReplyItem] = field(default_factory=asyncio.Queue)
    finish_reason: str = "stop"
    num_completion_tokens: int = 0
    num_audio_frames: int = 0
    num_cached_tokens: int = 0  # prompt tokens the first stage reused from a resident slot
    num_prompt_audio_tokens: int = 0  # of num_prompt_tokens, the input audio's
    num_prompt_image_tokens: int = 0  # of num_prompt_tokens, the input images'
    closed: bool = False
    num_buffered_bytes: int = 0
    served_by: set[str] = field(default_factory=set)  # stages that have given it an output

    def push(self, item: ReplyItem) -> None:
        """From a stage thread: handed to the event loop, never waited for."""
        self.loop.call_soon_threadsafe(self.put, item)

    def put(self, item: ReplyItem) -> None:
        """On the event loop."""
        self.queue.put_nowait(item)
        self.num_buffered_bytes += _num_bytes(item)
        if self.num_buffered_bytes > self.max_buffered_bytes and not self.closed:
            self.on_overflow(self)

    async def get(self) -> ReplyItem:
        item = await self.queue.get()
        self.num_buffered_bytes -= _num_bytes(item)
        return item


class BlockingReplyStream(ReplyStream):
    """`async_output: false` (an ablation): the stage thread waits until the event loop has taken each output."""

    __slots__ = ()

    def push(self, item: ReplyItem) -> None:
        asyncio.run_coroutine_threadsafe(self._put_async(item), self.loop).result()

    async def _put_async(self, item: ReplyItem) -> None:
        self.put(item)


def _num_bytes(item: ReplyItem) -> int:
    return 64 + (len(item.pcm16) if isinstance(item, AudioPcm) else 0)
