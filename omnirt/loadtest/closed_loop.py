"""The chat bench's load: c workers, each a closed loop (its next request leaves when its last reply ended).

`steady`, the default: the workers run through a warm-up, then a measured window of at least `window_s` that goes
on until every worker has completed `min_requests` requests started inside it. The window's throughput counts
every reply completed inside it (a closed loop's rate: the ones in flight at its edges are as many going out as
coming in); its latencies are those of the replies that started and ended inside it, none of the warm-up's.
Requests still running when the window closes are cancelled and not counted.

`wave`, a diagnostic: a fixed number of requests shared by the c workers, then the point ends; its start and its
tail run fewer than c requests at once (the old shape of a point, kept to reproduce its figures).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

Send = Callable[[], Awaitable[Any]]  # one request, returning its sample
Edge = Callable[[], Awaitable[Any]]  # called as the window opens and as it closes (e.g. a /metrics scrape)


@dataclass(slots=True)
class Timed:
    worker: int
    start_s: float  # since the load began
    end_s: float
    sample: Any


@dataclass(slots=True)
class Window:
    records: list[Timed]
    start_s: float
    end_s: float
    edges: tuple[Any, Any] = (None, None)  # what `Edge` returned at the window's opening and closing
    concurrency: int = 1

    @property
    def length_s(self) -> float:
        return self.end_s - self.start_s

    def completed(self) -> list[Timed]:
        """Replies that ended inside the window (the throughput's count)."""
        return [r for r in self.records if self.start_s <= r.end_s <= self.end_s]

    def measured(self) -> list[Timed]:
        """Replies that started and ended inside the window (the latencies')."""
        return [r for r in self.completed() if r.start_s >= self.start_s]

    def per_worker(self) -> list[int]:
        """Measured replies of each worker."""
        counts = [0] * self.concurrency
        for r in self.measured():
            counts[r.worker] += 1
        return counts


async def steady(send: Send, concurrency: int, warmup_s: float, window_s: float, min_requests: int,
                 edge: Edge | None = None) -> Window:
    loop = asyncio.get_running_loop()
    t0, records, enough = loop.time(), [], asyncio.Event()
    start_s = warmup_s

    def has_enough(now_s: float) -> bool:
        if now_s < start_s + window_s:
            return False
        counts = [0] * concurrency
        for r in records:
            counts[r.worker] += r.start_s >= start_s
        return min(counts) >= min_requests

    async def worker(i: int) -> None:
        while True:
            begun = loop.time() - t0
            sample = await send()
            records.append(Timed(i, begun, loop.time() - t0, sample))
            if has_enough(records[-1].end_s):
                enough.set()

    tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        opening = await edge() if edge else None
        await asyncio.sleep(max(0.0, t0 + start_s + window_s - loop.time()))
        if not has_enough(loop.time() - t0):
            await _until(enough, tasks)
        end_s = loop.time() - t0
        closing = await edge() if edge else None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Window([r for r in records if r.end_s <= end_s], start_s, end_s, (opening, closing), concurrency)


async def _until(event: asyncio.Event, workers: list[asyncio.Task]) -> None:
    """Wait for `event`; a worker that failed meanwhile raises its error instead of leaving the window open."""
    waiter = asyncio.create_task(event.wait())
    done, _ = await asyncio.wait([waiter, *workers], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    for task in done - {waiter}:
        task.result()


async def wave(send: Send, concurrency: int, num_requests: int, edge: Edge | None = None) -> Window:
    """`num_requests` requests through `concurrency` workers; the window is the whole wave."""
    loop = asyncio.get_running_loop()
    left, records = [num_requests], []
    opening = await edge() if edge else None
    t0 = loop.time()

    async def worker(i: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            begun = loop.time() - t0
            sample = await send()
            records.append(Timed(i, begun, loop.time() - t0, sample))

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    end_s = loop.time() - t0
    closing = await edge() if edge else None
    return Window(records, 0.0, end_s, (opening, closing), concurrency)


@dataclass(slots=True)
class Plan:
    """How a point's load is shaped, as the bench's flags say."""

    is_wave: bool = False
    warmup_s: float = 20.0
    window_s: float = 60.0
    min_requests: int = 8
    warmup_requests: int = 4  # --wave: requests before the wave, not counted
    requests_per_point: int = 8  # --wave: at least this many
    rounds: int = 2  # --wave: requests per worker

    async def run(self, send: Send, concurrency: int, edge: Edge | None = None) -> Window:
        if not self.is_wave:
            return await steady(send, concurrency, self.warmup_s, self.window_s, self.min_requests, edge)
        await wave(send, min(concurrency, self.warmup_requests), self.warmup_requests)
        return await wave(send, concurrency, max(self.requests_per_point, concurrency * self.rounds), edge)
