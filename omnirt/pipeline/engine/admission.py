"""Admission control: each stage serves `max_num_seqs` requests and lets at most `max_waiting` more
wait for a slot. A request that would overfill any stage it needs is refused before it starts,
so the requests already running keep their latency and memory stays bounded under overload."""

from __future__ import annotations

import threading

from omnirt.pipeline.types import EngineOverloaded, StageLimit


class Admission:
    """Counts the requests admitted per stage. `admit` runs on the event loop, `release` on any thread."""

    def __init__(self, limits: dict[str, StageLimit], retry_after_s: float = 1.0):
        self.limits = limits
        self.retry_after_s = retry_after_s
        self.num_admitted = dict.fromkeys(limits, 0)
        self.num_refused = 0
        self._lock = threading.Lock()

    def check(self, stages: tuple[str, ...]) -> None:
        """Raise EngineOverloaded if one more request through `stages` would not fit (admits nothing)."""
        with self._lock:
            self._check(stages)

    def admit(self, stages: tuple[str, ...]) -> None:
        with self._lock:
            self._check(stages)
            for s in stages:
                self.num_admitted[s] += 1

    def release(self, stages: tuple[str, ...]) -> None:
        with self._lock:
            for s in stages:
                self.num_admitted[s] -= 1

    def num_waiting(self, stage: str) -> int:
        """Requests admitted beyond the stage's slots: the depth of its wait queue."""
        return max(0, self.num_admitted[stage] - self.limits[stage].max_num_seqs)

    def _check(self, stages: tuple[str, ...]) -> None:
        for s in stages:
            if self.num_admitted[s] >= self.limits[s].capacity:
                self.num_refused += 1
                raise EngineOverloaded(s, self.limits[s].capacity, self.retry_after_s)
