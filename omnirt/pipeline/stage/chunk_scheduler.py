"""Batching for a stage without a KV cache whose requests run in windows (Code2Wav's codec chunks): a request
runs whenever its state says its next window is due, up to `max_num_seqs` windows per step."""

from __future__ import annotations

from typing import Protocol

from omnirt.pipeline.stage.priority import Priority, WaitCounts, in_arrival_order, ranked
from omnirt.pipeline.stage.protocols import PrefixStats
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.step import Batch, RowOutput


class WindowStream(Protocol):
    """A request's state in such a stage (Qwen3-Omni's `CodecStream`)."""

    num_emitted: int  # frames already decoded and sent

    def is_ready(self) -> bool:
        """Its next window is due now."""

    def next_window(self) -> tuple[object, int]:
        """(the window to decode, the frames it emits)."""

    def advance(self, num_frames: int) -> None: ...

    def is_drained(self) -> bool: ...


def _is_first_chunk(req: StageRequest) -> bool:
    return req.state.num_emitted == 0


class ChunkScheduler:
    """No KV cache; a request (its `state` a `WindowStream`) runs whenever its next window is due, up to
    `max_num_seqs` windows per step. With a `Priority`, first chunks go first, in a step of their own unless
    another window is overdue: a first chunk has no left context, so alone it is a short step, where beside
    longer windows it would be padded to their length."""

    def __init__(self, max_num_seqs: int, priority: Priority | None = None):
        self.max_num_seqs = max_num_seqs
        self.priority = priority
        self.requests: list[StageRequest] = []
        self.waits = WaitCounts()

    num_waiting = 0  # a request waits only for its next window, never for a slot
    num_free_slots = num_slots = 0  # no KV cache

    @property
    def num_running(self) -> int:
        return len(self.requests)

    def prefix_stats(self) -> PrefixStats:
        return PrefixStats()  # nothing resident to reuse

    def take_cached(self) -> list[tuple[str, int]]:
        return []

    def add(self, req: StageRequest) -> None:
        req.status = RequestStatus.WAITING_FOR_INPUT
        self.requests.append(req)

    def schedule(self) -> Batch | None:
        ready = [r for r in self.requests if r.state.is_ready()]
        if not ready:
            return None
        chosen = self._pick(ready)
        self.waits.account(ready, chosen, len(ready) - len(chosen))
        for r in chosen:
            r.status = RequestStatus.RUNNING
        return Batch(chosen, [r.state.next_window()[1] for r in chosen], is_prefill=False)

    def _pick(self, ready: list[StageRequest]) -> list[StageRequest]:
        chosen = ranked(self.priority, ready, _is_first_chunk)[: self.max_num_seqs]
        if self.priority is not None and not any(self.priority.is_overdue(r) for r in chosen):
            chosen = [r for r in chosen if _is_first_chunk(r)] or chosen
        return in_arrival_order(chosen, ready)

    def launched(self, batch: Batch) -> None:
        """Nothing to count ahead: a window advances its stream when its samples come back (`update`)."""

    def update(self, batch: Batch, outputs: list[RowOutput]) -> list[StageRequest]:
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
