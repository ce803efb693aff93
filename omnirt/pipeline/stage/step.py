"""What one step of a stage takes and gives: the batch its scheduler picked, the model's output for each row,
and the `StepResult` the stage reports (the same type wherever the stage runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from omnirt.pipeline.stage.request import RequestStatus, StageRequest


@dataclass(slots=True)
class Batch:
    requests: list[StageRequest]
    num_new_tokens: list[int]
    is_prefill: bool


@dataclass(slots=True)
class RowOutput:
    """A model's result for one request of a batch: logits to sample from (None while a prompt is
    still being prefilled) and the payload for the next stage."""

    logits: torch.Tensor | None = None
    payload: Any = None
    token: int | None = None
    # the inner codebooks' logits [codebooks, vocab] of the frame the step completed (the parity check reads them)
    inner_logits: torch.Tensor | None = None



class StageOutput(NamedTuple):
    """One request's result of one step: the sampled token (None while prefilling, or for a stage that
    samples nothing) and the payload for the next stage or the client."""

    request_id: str
    token: int | None
    payload: Any


class Finish(NamedTuple):
    """A request that ended in a stage, in a step or outside one (abort, error, nothing left to do)."""

    request_id: str
    status: RequestStatus
    num_output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class StepResult:
    """What a stage reports, the same type wherever it runs (a thread, a worker process, a Ray actor)."""

    outputs: list[StageOutput] = field(default_factory=list)
    finished: list[Finish] = field(default_factory=list)
    cached: list[tuple[str, int]] = field(default_factory=list)  # (request id, prompt tokens reused) of new hits
