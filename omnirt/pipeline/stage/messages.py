"""What a stage's inbox carries: a new request, an upstream chunk (one or a step's worth), the upstream's end,
an abort. The same messages reach a stage in this process, in a worker process or in a Ray actor."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Command(enum.Enum):
    ADD = "add"  # a new StageRequest
    INPUT = "input"  # a chunk from the upstream stage
    INPUTS = "inputs"  # one step's chunks for several requests: payload [(request_id, chunk), ...]
    INPUT_DONE = "input_done"  # the upstream stage finished this request
    ABORT = "abort"


@dataclass(slots=True, frozen=True)
class StageMessage:
    command: Command
    request_id: str
    payload: Any = None
