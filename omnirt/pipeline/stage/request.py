"""A request's life inside one stage: its status and progress counters (the request and event types
that cross the engine boundary are in `omnirt/pipeline/types.py`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from omnirt.pipeline.stage.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Only the owning stage's scheduler (and abort) changes it; finished states sort last."""

    WAITING = 0  # admitted, no slot yet
    WAITING_FOR_INPUT = 1  # holds a slot, waits for the upstream stage's next chunk
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True)
class StageRequest:
    """A request's life inside one stage. Progress is counters, not phase flags."""

    request_id: str
    sampling: SamplingParams
    state: Any = None  # the model adapter's per-request data
    status: RequestStatus = RequestStatus.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, taken from a resident slot (omnirt/pipeline/stage/prefix_cache.py)
    output_ids: list[int] = field(default_factory=list)
    num_pending: int = 0  # sampled in a step still in flight (async scheduling): not yet in output_ids
    slot: int | None = None
    generator: Any = None  # torch.Generator when seeded
    constraint: Any = None  # omnirt.pipeline.stage.grammar.Constraint: the grammar its sampled tokens must follow
    error: str | None = None
    num_first_packet_outputs: int = 1  # outputs here before the request's first packet can reach the client
    num_steps: int = 0  # steps of this stage it took part in
    num_waited_steps: int = 0  # steps of this stage it could have run in but was left out of, since its last

    @property
    def is_owed_first_packet(self) -> bool:
        """Its first packet still waits on this stage's outputs (`omnirt/pipeline/stage/priority.py` serves it
        first)."""
        return self.num_outputs < self.num_first_packet_outputs

    @property
    def num_outputs(self) -> int:
        """Tokens sampled so far, those of a step still in flight included."""
        return len(self.output_ids) + self.num_pending

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
