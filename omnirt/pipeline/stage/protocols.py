"""The seams of a stage, typed: what its step loop asks of a scheduler and a runner, what an autoregressive
model gives the runner, what watches its steps, and the handle the engine holds on a stage wherever it runs
(a thread here, a pool of worker processes, Ray actors). Each part says what it is instead of being probed."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from omnirt.pipeline.stage.messages import StageMessage
from omnirt.pipeline.stage.priority import WaitCounts
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.step import Batch, RowOutput
from omnirt.pipeline.types import StageStats

PLACEMENTS = ("fresh", "taken_over", "copied", "restored")  # how a request got its slot (`SlotScheduler._place`)


class PrefixStats(NamedTuple):
    num_prefill_tokens: int = 0  # prompt tokens computed by prefill steps
    num_cached_tokens: int = 0  # prompt tokens reused from resident slots instead
    num_resident_slots: int = 0  # slots holding an ended request's KV for reuse
    num_resident_bytes: int = 0  # memory those keep beyond the KV cache
    num_offloaded: int = 0  # prefixes of resident slots given up, kept in the host tier
    num_offloaded_bytes: int = 0  # host memory those take
    num_restored_tokens: int = 0  # prompt tokens copied back from there (counted in num_cached_tokens)
    placements: dict[str, int] | None = None  # requests by how they got their slot (PLACEMENTS)
    num_given_up: int = 0  # resident slots given up for another request (to the host tier, if any)


class Scheduler(Protocol):
    """Decides which requests take the next step; only it (and a finish from outside a step) changes a
    request's status."""

    max_num_seqs: int
    waits: WaitCounts

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_free_slots(self) -> int:
        """KV slots a new request could take (resident ones included); 0 for a stage without a KV cache."""

    @property
    def num_slots(self) -> int: ...

    def add(self, req: StageRequest) -> None: ...

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when no request can step."""

    def launched(self, batch: Batch) -> None:
        """The step was issued: count what it computes (its results come in `update`)."""

    def update(self, batch: Batch, outputs: list[RowOutput]) -> list[StageRequest]:
        """Apply the step's results; the requests that finished in it."""

    def finish(self, req: StageRequest, status: RequestStatus) -> None: ...

    def prefix_stats(self) -> PrefixStats: ...

    def take_cached(self) -> list[tuple[str, int]]:
        """(request id, prompt tokens reused) of the prefix hits since the last call."""


class Runner(Protocol):
    """Runs a batch on the model and returns one output per row."""

    can_schedule_ahead: bool  # `launch` may issue a step before the last one's results are collected
    waited_s: float  # seconds spent waiting for the device's results (for /metrics)

    def run(self, batch: Batch) -> list[RowOutput]: ...


class AheadRunner(Runner, Protocol):
    """A runner that can issue a step and collect its results later (async scheduling)."""

    def launch(self, batch: Batch) -> Any:
        """Issue the step; what `collect` takes."""

    def collect(self, step: Any) -> list[RowOutput]: ...


class StepModel(Protocol):
    """An autoregressive stage model, as `ARRunner` drives it."""

    device: torch.device
    reads_device_tokens: bool  # its steps take their input tokens from the device (async scheduling may run)

    def run(self, batch: Batch) -> list[RowOutput]:
        """Logits (and, while a prompt is prefilling, nothing) per row."""

    def complete(self, reqs: list[StageRequest], outs: list[RowOutput], sampled: list[int],
                 tokens: torch.Tensor | None) -> list[Any]:
        """Each row's hand-off payload, built from the step's sampled tokens while they are on the device."""


class StepObserver(Protocol):
    """Watches a stage's steps from its thread: counters for /metrics, the step log."""

    def observe(self, stage: str, batch: Batch | None, elapsed_s: float, overlapped: bool = False) -> None:
        """A step issued (and with async scheduling the one before it landed) in `elapsed_s`, `overlapped` when
        it was issued while the one before was still in flight; `batch` None: the wait for a step in flight
        when nothing new was issued."""

    def close(self) -> None: ...


class StageControl(Protocol):
    """What a model's graph callbacks may do to the stage they run in (`StageParts.on_input_done`)."""

    def finish(self, req: StageRequest, status: RequestStatus, error: str | None = None) -> None: ...


class StageHandle(Protocol):
    """The engine's handle on one stage: a thread in this process, or a pool of replicas."""

    name: str

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def send(self, msg: StageMessage) -> None: ...

    def send_inputs(self, items: list[tuple[str, Any]]) -> None:
        """One upstream step's chunks, for several requests."""

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    def stats(self) -> StageStats:
        """Its slots, queues and step counters (what the engine knows of it, it adds)."""

    def replica_status(self) -> list[dict[str, Any]]:
        """Each replica's state and load (an in-process stage is one replica that is up)."""
