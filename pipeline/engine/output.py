"""Async output: each request's event queue, filled from stage threads and read by the consumer.

Stage threads only hand raw results (token ids, PCM) to the event loop; the queue is bounded in
bytes, and a consumer that stops reading gets its request aborted (`on_overflow`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.types import OmniRequest


@dataclass(slots=True)
class RequestOutput:
    """Engine-side record of one request: the queue its events go to, filled from stage threads.
    The queue is bounded in bytes: a consumer that stops reading gets its request aborted."""

    request: OmniRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    stages: tuple[str, ...]  # the stages it was admitted to
    max_buffered_bytes: int
    on_overflow: Callable[[RequestOutput], None]  # called on the event loop once the bound is crossed
    finish_reason: str = "stop"
    num_completion_tokens: int = 0
    num_audio_frames: int = 0
    num_cached_tokens: int = 0  # prompt tokens the first stage reused from a resident slot
    closed: bool = False
    num_buffered_bytes: int = 0
    async_output: bool = True
    truncated_messages: int = 0  # leading conversation messages the prompt left out
    submitted_at: float = 0.0  # time.perf_counter() when the engine got it (pipeline/engine/timeline.py)
    served_by: set[str] = field(default_factory=set)  # stages that have given it an output

    def push(self, item: tuple) -> None:
        """From a stage thread."""
        if self.async_output:
            self.loop.call_soon_threadsafe(self.put, item)
        else:  # ablation: the stage thread waits until the event loop has taken the output
            asyncio.run_coroutine_threadsafe(self._put_async(item), self.loop).result()

    async def _put_async(self, item: tuple) -> None:
        self.put(item)

    def put(self, item: tuple) -> None:
        """On the event loop."""
        self.queue.put_nowait(item)
        self.num_buffered_bytes += _num_bytes(item)
        if self.num_buffered_bytes > self.max_buffered_bytes and not self.closed:
            self.on_overflow(self)

    async def get(self) -> tuple:
        item = await self.queue.get()
        self.num_buffered_bytes -= _num_bytes(item)
        return item


def _num_bytes(item: tuple) -> int:
    return 64 + (len(item[1]) if item[0] == "audio" else 0)


