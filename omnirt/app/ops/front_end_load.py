"""How loaded this API process's audio front end is, and so whether it takes a new Realtime session.

Two figures, each the process's own (with `--api-workers` every worker has its own event loop and VAD):
- loop lag: a probe task sleeps `PROBE_INTERVAL_S` and measures how late it wakes. A loop busy with audio
  (JSON, base64, resampling, the sessions' protocol work) wakes it late, and every session's events wait as
  long; it is what makes an admitted session fall behind.
- VAD backlog: how long the oldest audio waiting for the batched VAD (`omnirt/app/audio/rounds.py`) has waited, read
  at each probe, and how many sessions' windows wait.
Both are smoothed (an exponential average over about half a second of probes), so that one pause of the loop
(a garbage collection, a large event) does not refuse sessions while a loop that stays busy does. Past the
deploy profile's `front_end` limits a new session is refused (`omnirt.app.ops.admission`): the server says "full"
before the sessions it holds fall behind. Sessions already open are never dropped for load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from omnirt.pipeline.api import FrontEndLimits

PROBE_INTERVAL_S = 0.1
SMOOTHING = 0.2  # each probe's weight in the average: a change shows by about half within 3 probes


class Backlog(Protocol):
    """What waits for a batched model (`omnirt.app.audio.rounds.Rounds`)."""

    @property
    def num_waiting(self) -> int: ...

    def oldest_wait_s(self) -> float: ...


@dataclass(slots=True, frozen=True)
class LoadFigures:
    """The figures /health and /metrics show: the smoothed lags, the sessions waiting for the VAD now, and
    whether a new session would be let in."""

    loop_lag_ms: float
    vad_backlog_ms: float
    vad_waiting: int
    is_admitting: bool

    def as_json(self) -> dict:
        return {"loop_lag_ms": round(self.loop_lag_ms, 1), "vad_backlog_ms": round(self.vad_backlog_ms, 1),
                "vad_waiting": self.vad_waiting, "admitting": self.is_admitting}


class FrontEndLoad:
    """`start()` the probe on the process's loop; `refusal()` says why a new session must wait, if it must.
    `limits` None (or a limit None): never refuses for that figure, still measures it."""

    def __init__(self, limits: FrontEndLimits | None, backlog: Backlog, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep):
        self.limits = limits or FrontEndLimits()
        self.backlog, self._clock, self._sleep = backlog, clock, sleep
        self.loop_lag_s = self.vad_backlog_s = 0.0  # smoothed
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.probe())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def probe(self) -> None:
        """Forever: sleep, measure how late the wake-up came, and fold it in with the VAD's backlog."""
        while True:
            asleep_at = self._clock()
            await self._sleep(PROBE_INTERVAL_S)
            self.observe(self._clock() - asleep_at - PROBE_INTERVAL_S)

    def observe(self, loop_lag_s: float) -> None:
        """One probe: the loop's lateness just measured, and the VAD's backlog as it stands."""
        self.loop_lag_s += SMOOTHING * (max(0.0, loop_lag_s) - self.loop_lag_s)
        self.vad_backlog_s += SMOOTHING * (self.backlog.oldest_wait_s() - self.vad_backlog_s)

    def refusal(self) -> str | None:
        """Why a new session must wait (a figure past its limit), or None: it may open."""
        for what, value_s, limit_ms in (("the event loop runs", self.loop_lag_s, self.limits.max_loop_lag_ms),
                                        ("audio waits for the VAD", self.vad_backlog_s,
                                         self.limits.max_vad_backlog_ms)):
            if limit_ms is not None and value_s * 1000 > limit_ms:
                return (f"the server's audio front end is at capacity ({what} {value_s * 1000:.0f} ms late; the "
                        f"limit is {limit_ms:g} ms); try again later")
        return None

    def figures(self) -> LoadFigures:
        return LoadFigures(self.loop_lag_s * 1000, self.vad_backlog_s * 1000, self.backlog.num_waiting,
                           self.refusal() is None)
