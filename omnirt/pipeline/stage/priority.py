"""First packet first: the order in which a stage's runnable requests take a step's rows.

When more requests are runnable than a step holds (`max_num_seqs` rows, or a prefill step's token budget),
a stage serves first those that have waited `max_wait_steps` steps since their last one (most waited first:
aging, so no request starves), then those still owed their first packet (in arrival order: the first audio
packet, or the first text delta of a text-only reply), then the rest, most waited first. Without a
`Priority` the stage takes them in arrival order. A step's rows keep arrival order whatever picked them, so
that the policy changes which requests run, never what a batch computes for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omnirt.pipeline.stage.request import StageRequest

IsOwed = Callable[[StageRequest], bool]  # is its first packet still waiting on this stage?


@dataclass(slots=True, frozen=True)
class Priority:
    max_wait_steps: int = 4  # aging: a runnable request left out this many steps in a row goes first

    @classmethod
    def from_config(cls, cfg) -> Priority | None:
        """The engine config's policy (`first_packet_priority`, `max_wait_steps`); None when it is off."""
        return cls(cfg.max_wait_steps) if cfg.first_packet_priority else None

    def ranked(self, reqs: list[StageRequest], is_owed: IsOwed) -> list[StageRequest]:
        """`reqs` (in arrival order), the one to serve first first."""
        return sorted(reqs, key=lambda r: self._rank(r, is_owed))  # stable: arrival order among equals

    def is_overdue(self, req: StageRequest) -> bool:
        return req.num_waited_steps >= self.max_wait_steps

    def _rank(self, req: StageRequest, is_owed: IsOwed) -> tuple[int, int]:
        if self.is_overdue(req):
            return 0, -req.num_waited_steps
        if is_owed(req):
            return 1, 0
        return 2, -req.num_waited_steps


def ranked(priority: Priority | None, reqs: list[StageRequest], is_owed: IsOwed) -> list[StageRequest]:
    return reqs if priority is None else priority.ranked(reqs, is_owed)


def in_arrival_order(chosen: list[StageRequest], reqs: list[StageRequest]) -> list[StageRequest]:
    """The chosen ones of `reqs`, in the order of `reqs`."""
    picked = {id(r) for r in chosen}
    return [r for r in reqs if id(r) in picked]


class WaitCounts:
    """How long runnable requests wait for a step, for /metrics (counted with the priority on or off)."""

    def __init__(self):
        self.num_first_steps = 0  # requests that took their first step here
        self.first_wait_steps = 0  # the steps they waited, runnable, before it (summed)
        self.max_wait_steps = 0  # the most steps a runnable request waited between two of its steps
        self.num_deferred = 0  # runnable requests with a slot, of the step's kind, that it left out

    def account(self, runnable: list[StageRequest], chosen: list[StageRequest], num_deferred: int) -> None:
        """One step: `chosen` ran it, the rest of `runnable` waited it."""
        picked = {id(r) for r in chosen}
        for r in runnable:
            if id(r) not in picked:
                r.num_waited_steps += 1
                continue
            if r.num_steps == 0:
                self.num_first_steps += 1
                self.first_wait_steps += r.num_waited_steps
            self.max_wait_steps = max(self.max_wait_steps, r.num_waited_steps)
            r.num_waited_steps = 0
            r.num_steps += 1
        self.num_deferred += num_deferred

    def snapshot(self) -> dict[str, int]:
        """As `StageStats` names them."""
        return {"first_steps": self.num_first_steps, "first_wait_steps": self.first_wait_steps,
                "max_wait_steps": self.max_wait_steps, "deferred_rows": self.num_deferred}
