"""Batched rounds on a thread of their own: what every session of the process asks of one model (Silero's
windows, Smart Turn's pauses, RNNoise's frames) is gathered while the previous round runs and done together in
the next, so the cost per item falls with the number of sessions and no model call runs on the event loop. With a
tick, a round starts at most once a tick: many sessions' 20 ms chunks arrive spread over the tick, and a round
for each as it came would cost a model call (and a thread hop) per session instead of one per tick. What waits for
a round (`num_waiting`, `oldest_wait_s`) is the model's backlog: the server's load signal reads it
(`omnirt/app/ops/front_end_load.py`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol


class Job(Protocol):
    def is_pending(self) -> bool:
        """More to do in a later round (a job larger than one round's share)."""

    def result(self) -> Any:
        """What the waiting session gets once the job is no longer pending."""


class Rounds:
    """`await submit(job)` from any session; `run_round(jobs)` runs on the thread for all jobs pending."""

    def __init__(self, run_round: Callable[[list[Job]], None], thread_name: str, tick_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self._run_round, self._clock = run_round, clock
        self.tick_s = tick_s  # a round starts at least this long after the previous one began
        self._jobs: list[tuple[Job, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._last_start = float("-inf")
        self.num_rounds = 0
        self._queued_at = 0.0  # when the oldest job of `_jobs` came (valid while there is one)
        self._running_since: float | None = None  # when the oldest job of the running round came
        self._num_running = 0

    @property
    def num_waiting(self) -> int:
        """Jobs not answered yet: in the running round or queued for the next."""
        return self._num_running + len(self._jobs)

    def oldest_wait_s(self) -> float:
        """How long the oldest job not answered yet has waited (0.0: none waits)."""
        starts = [t for t, is_live in ((self._running_since, self._running_since is not None),
                                       (self._queued_at, bool(self._jobs))) if is_live]
        return self._clock() - min(starts) if starts else 0.0

    async def submit(self, job: Job) -> Any:
        done = asyncio.get_running_loop().create_future()
        if not self._jobs:
            self._queued_at = self._clock()
        self._jobs.append((job, done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return await done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._jobs:
            if (wait := self._last_start + self.tick_s - loop.time()) > 0:
                await asyncio.sleep(wait)  # what arrives meanwhile joins this round
            self._last_start = loop.time()
            pending, self._jobs = self._jobs, []
            self._running_since, self._num_running = self._queued_at, len(pending)
            self.num_rounds += 1
            try:
                await loop.run_in_executor(self._executor, self._run_round, [job for job, _ in pending])
            except Exception as exc:  # a broken model fails the waiting sessions' audio, not the loop
                for _, done in pending:
                    if not done.done():
                        done.set_exception(exc)
                continue
            finally:
                since, self._running_since, self._num_running = self._running_since, None, 0
            for job, done in pending:
                if job.is_pending():
                    self._queued_at = since  # older than any job that came during the round
                    self._jobs.append((job, done))  # more than one round's worth: it goes on in the next round
                elif not done.done():
                    done.set_result(job.result())
