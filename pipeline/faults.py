"""Test-time fault injection: make one stage raise for marked requests, inside the real engine.

Configured once (`EngineConfig.fault_injection`, from `--fault-inject` or `OMNIRT_FAULT_INJECT`) as
`STAGE[:after=N]`: a request whose text contains `FAULT_MARKER` makes that stage's step raise
`InjectedFault` once the request has been in N of its batches. Off (None) in normal serving.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pipeline.scheduler import Batch, StepOutput

FAULT_MARKER = "__omnirt_fault__"


class InjectedFault(RuntimeError):
    pass


@dataclass(slots=True, frozen=True)
class FaultSpec:
    stage: str
    after_steps: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        stage, _, rest = text.partition(":")
        after = 0
        if rest:
            key, _, value = rest.partition("=")
            if key != "after" or not value.isdigit():
                raise ValueError(f"fault injection {text!r}: expected STAGE[:after=N]")
            after = int(value)
        return cls(stage, after)


def is_marked(messages: list[dict]) -> bool:
    for m in messages:
        content = m["content"]
        texts = [content] if isinstance(content, str) else [p.get("text") or "" for p in content]
        if any(FAULT_MARKER in t for t in texts):
            return True
    return False


class FaultInjector:
    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self._steps: dict[str, int] = {}  # marked request id -> batches seen in the faulty stage
        self._lock = threading.Lock()

    def mark(self, request_id: str, messages: list[dict]) -> None:
        if is_marked(messages):
            with self._lock:
                self._steps[request_id] = 0

    def wrap(self, stage: str, runner):
        return _FaultyRunner(runner, self) if stage == self.spec.stage else runner

    def check(self, batch: Batch) -> None:
        with self._lock:
            for req in batch.requests:
                n = self._steps.get(req.request_id)
                if n is None:
                    continue
                self._steps[req.request_id] = n + 1
                if n >= self.spec.after_steps:
                    raise InjectedFault(f"injected fault for {req.request_id} in {self.spec.stage}")


class _FaultyRunner:
    def __init__(self, runner, injector: FaultInjector):
        self.runner, self.injector = runner, injector

    def run(self, batch: Batch) -> list[StepOutput]:
        self.injector.check(batch)
        return self.runner.run(batch)
