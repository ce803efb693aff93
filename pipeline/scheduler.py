"""Continuous batching for one autoregressive stage: admit into slots, pick a batch, retire.

There is no prefill or decode phase on a request: each has `num_computed_tokens` catching up with
its token count. A step is either a prefill batch (prompt chunks within `max_num_batched_tokens`)
or a decode batch (one token per running request); when both are waiting they alternate, so a
long prompt never stalls the decoders for more than one step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.kv_cache import SlotKVCache
from pipeline.request import RequestStatus, StageRequest


@dataclass(slots=True)
class Batch:
    requests: list[StageRequest]
    num_new_tokens: list[int]
    is_prefill: bool


@dataclass(slots=True)
class StepOutput:
    """A model's result for one request of a batch: logits to sample from (None while a prompt is
    still being prefilled) and the payload for the next stage."""

    logits: torch.Tensor | None = None
    payload: Any = None
    token: int | None = None


class Scheduler:
    def __init__(self, kv: SlotKVCache, max_num_seqs: int, max_num_batched_tokens: int, eos_ids: list[int],
                 is_ready: Callable[[StageRequest], bool]):
        self.kv = kv
        self.max_num_seqs = min(max_num_seqs, kv.num_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_ids = set(eos_ids)
        self.is_ready = is_ready  # may the request take its next step (its inputs have arrived)?
        self.waiting: deque[StageRequest] = deque()
        self.running: list[StageRequest] = []
        self._last_was_prefill = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, req: StageRequest) -> None:
        self.waiting.append(req)

    def schedule(self) -> Batch | None:
        self._admit()
        ready = [r for r in self.running if self.is_ready(r)]
        prefill = [r for r in ready if r.is_prefill]
        decode = [r for r in ready if not r.is_prefill]
        if prefill and not (decode and self._last_was_prefill):
            self._last_was_prefill = True
            return self._prefill_batch(prefill)
        self._last_was_prefill = False
        return Batch(decode, [1] * len(decode), is_prefill=False) if decode else None

    def _admit(self) -> None:
        """Give slots to waiting requests whose first input is there, oldest first."""
        for req in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if self.is_ready(req):
                self.waiting.remove(req)
                req.slot = self.kv.allocate()
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def _prefill_batch(self, reqs: list[StageRequest]) -> Batch:
        chosen, counts, budget = [], [], self.max_num_batched_tokens
        for req in reqs:
            n = min(req.num_prompt_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                break
            chosen.append(req)
            counts.append(n)
            budget -= n
        return Batch(chosen, counts, is_prefill=True)

    def update(self, batch: Batch, outputs: list[StepOutput]) -> list[StageRequest]:
        """Apply a step's results; returns the requests that finished in it (slots already freed)."""
        finished = []
        for req, n, out in zip(batch.requests, batch.num_new_tokens, outputs, strict=True):
            if req.status.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if out.token is not None:
                req.output_ids.append(out.token)
                self._check_stop(req)
            if req.status.is_finished:
                self._retire(req)
                finished.append(req)
        return finished

    def _check_stop(self, req: StageRequest) -> None:
        if req.output_ids[-1] in self.eos_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_ids) >= req.sampling.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    def finish(self, req: StageRequest, status: RequestStatus) -> None:
        """End a request from outside a step (abort, error, or no work left)."""
        if req.status.is_finished:
            return
        req.status = status
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._retire(req)

    def _retire(self, req: StageRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.kv.free(req.slot)
            req.slot = None


class ChunkScheduler:
    """Code2Wav batching: no KV cache; a request runs whenever its next codec window is due
    (its `state` is a `connector.CodecStream`), up to `max_num_seqs` windows per step."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.requests: list[StageRequest] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    num_waiting = 0  # a request waits only for its next codec window, never for a slot

    @property
    def num_running(self) -> int:
        return len(self.requests)

    def add(self, req: StageRequest) -> None:
        req.status = RequestStatus.WAITING_FOR_INPUT
        self.requests.append(req)

    def schedule(self) -> Batch | None:
        ready = [r for r in self.requests if r.state.is_ready()][: self.max_num_seqs]
        if not ready:
            return None
        for r in ready:
            r.status = RequestStatus.RUNNING
        return Batch(ready, [r.state.next_window()[1] for r in ready], is_prefill=False)

    def update(self, batch: Batch, outputs: list[StepOutput]) -> list[StageRequest]:
        finished = []
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if req.status.is_finished:
                continue
            req.state.advance(n)
            req.status = RequestStatus.WAITING_FOR_INPUT
            if req.state.is_drained():
                self.finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
        return finished

    def finish(self, req: StageRequest, status: RequestStatus) -> None:
        req.status = status
        if req in self.requests:
            self.requests.remove(req)
