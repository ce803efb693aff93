"""Test-only fault injection, plugged into a real in-process engine from outside: one stage's runner is
wrapped so that its step raises `InjectedFault` for marked requests (ids starting with `MARK`) once the
request has been in `after_steps` of that stage's batches, whether the stage runs its steps to their end or
issues them ahead (`launch`). Nothing in the engine knows about it."""

from __future__ import annotations

import threading

from omnirt.pipeline.stage.step import Batch, RowOutput

MARK = "bad-"


class InjectedFault(RuntimeError):
    pass


class FaultyRunner:
    def __init__(self, runner, stage: str, after_steps: int = 0):
        self.runner, self.stage, self.after_steps = runner, stage, after_steps
        self.can_schedule_ahead = runner.can_schedule_ahead
        self._steps: dict[str, int] = {}  # marked request id -> batches seen here
        self._lock = threading.Lock()

    @property
    def waited_s(self) -> float:
        return self.runner.waited_s

    def run(self, batch: Batch) -> list[RowOutput]:
        self._check(batch)
        return self.runner.run(batch)

    def launch(self, batch: Batch):
        """A step that would fail is refused before it counts: the stage then runs it with `run`, which does."""
        self._check(batch, count=False)
        self._check(batch)
        return self.runner.launch(batch)

    def collect(self, step) -> list[RowOutput]:
        return self.runner.collect(step)

    def _check(self, batch: Batch, count: bool = True) -> None:
        with self._lock:
            for req in batch.requests:
                if req.request_id.startswith(MARK):
                    n = self._steps.get(req.request_id, 0)
                    self._steps[req.request_id] = n + count
                    if n >= self.after_steps:
                        raise InjectedFault(f"injected fault for {req.request_id} in {self.stage}")


def inject(engine, stage: str, after_steps: int = 0) -> None:
    """Make `stage` of a started in-process engine fail for marked requests."""
    target = {s.name: s for s in engine.stages}[stage]
    target.runner = FaultyRunner(target.runner, stage, after_steps)
    if target.ahead is not None:
        target.ahead = target.runner
