"""A stage: a scheduler, a runner and a step loop on a thread of its own.

A step is `schedule()` -> `runner.run(batch)` -> `scheduler.update()`. Inputs (new requests, upstream chunks,
aborts) arrive through a queue and are applied between steps, so an abort that lands during a forward takes
effect before its results are applied. The loop never does IO: each step's `StepResult` goes to `on_step`,
which routes it along the model's stage graph; observers (counters, the step log) watch the steps.

With async scheduling (a stage's `async_scheduling`, where its runner can: the model reads its input tokens on
the device) the loop runs `_step_ahead` instead: step n+1 is scheduled and issued before step n's tokens come to
the host, and step n lands (its results applied and routed) while n+1 runs, so the host's per-step work
overlaps the device's instead of alternating with it. A request then has at most one token in flight; the
scheduler lets it step again unless that token is sure to end it, and a step issued after a token that does
end it (EOS) is void.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from omnirt.pipeline.config import EngineConfig, ProfileError
from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.graph import LoadedModels, StageParts
from omnirt.pipeline.stage.messages import Command, StageMessage
from omnirt.pipeline.stage.observers import StepCounters, StepLog
from omnirt.pipeline.stage.protocols import AheadRunner, StepObserver
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.step import Batch, Finish, RowOutput, StageOutput, StepResult
from omnirt.pipeline.types import StageStats

log = logging.getLogger(__name__)
StepSink = Callable[[str, StepResult], None]  # (stage name, what its step produced)


class Stage:
    def __init__(self, name: str, parts: StageParts, on_step: StepSink, platform: Platform | None = None,
                 schedules_ahead: bool = False, observers: tuple[StepObserver, ...] = ()):
        self.name = name
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.on_input = parts.on_input  # apply an upstream chunk to a request's state
        self.on_input_done = parts.on_input_done
        # async scheduling: step n+1 issued before step n's tokens land (`build_stage` checks the runner can)
        self.ahead: AheadRunner | None = parts.runner if schedules_ahead else None  # type: ignore[assignment]
        self.on_step = on_step
        self.stream = platform.stage_stream() if platform is not None else None  # None: the CPU
        self._stream_context = platform.stream_context if self.stream is not None else None
        self.counters = StepCounters(self.scheduler.max_num_seqs)
        self.observers = (self.counters, *observers)
        self.requests: dict[str, StageRequest] = {}
        self._inflight: tuple[Batch, Any] | None = None  # the step issued and not yet landed
        self._synced_s = 0.0  # waiting for the stream at the end of steps
        self._stopping = False
        self._inbox: queue.SimpleQueue[StageMessage | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"omnirt-{name}", daemon=True)

    # ---- what the engine reads (from other threads) ------------------------------------------------------

    @property
    def device_wait_s(self) -> float:
        """The part of busy_s spent waiting for the device (for the sampled tokens, and at the end of steps)."""
        return self._synced_s + self.runner.waited_s

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.num_free_slots

    @property
    def num_slots(self) -> int:
        return self.scheduler.num_slots

    @property
    def num_waiting(self) -> int:
        """Requests here without a slot yet, plus messages not yet applied."""
        return self.scheduler.num_waiting + self._inbox.qsize()

    def stats(self) -> StageStats:
        c, prefix = self.counters, self.scheduler.prefix_stats()
        return StageStats(self.name, self.num_free_slots, self.num_slots, running=self.scheduler.num_running,
                          waiting=self.num_waiting, batch_size_counts=list(c.batch_size_counts), busy_s=c.busy_s,
                          device_wait_s=self.device_wait_s, prefill_tokens=prefix.num_prefill_tokens,
                          cached_tokens=prefix.num_cached_tokens, resident_slots=prefix.num_resident_slots,
                          resident_bytes=prefix.num_resident_bytes, offloaded=prefix.num_offloaded,
                          offloaded_bytes=prefix.num_offloaded_bytes, restored_tokens=prefix.num_restored_tokens,
                          placements=prefix.placements, given_up=prefix.num_given_up,
                          **self.scheduler.waits.snapshot(),
                          decode_steps=c.num_decode_steps, decode_busy_s=c.decode_busy_s)

    def replica_status(self) -> list[dict[str, Any]]:
        """An in-process stage is one replica that is up."""
        return [{"replica": 0, "kind": "inline", "device": 0, "state": "up", "active_requests": len(self.requests),
                 "steps": self.counters.num_steps}]

    # ---- called from other threads ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        for observer in self.observers:
            observer.close()

    def send(self, msg: StageMessage) -> None:
        self._inbox.put(msg)

    def send_inputs(self, items: list[tuple[str, Any]]) -> None:
        """One upstream step's chunks, for several requests."""
        for rid, payload in items:
            self._inbox.put(StageMessage(Command.INPUT, rid, payload))

    # ---- the stage thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        with self._stream_context(self.stream) if self._stream_context else contextlib.nullcontext():
            self._run_loop()

    def _run_loop(self) -> None:
        step = self._step if self.ahead is None else self._step_ahead
        while self._drain(block=False):
            batch = self.scheduler.schedule()
            if batch is not None and batch.requests:
                step(batch)
            elif self._inflight is not None:  # nothing new to issue: the step in flight lands
                started = time.perf_counter()
                self._land()
                self._observe(None, started)
            elif not self._drain(block=True):
                return

    def _step(self, batch: Batch) -> None:
        """schedule -> run -> update: the step runs to its end and lands at once."""
        started = time.perf_counter()
        self._land()  # a step left in flight by async scheduling whose successor could not be issued
        ran, outputs = self._run_isolating(batch)
        self.scheduler.launched(ran)
        self._apply_step(ran, outputs)
        self._observe(batch, started)

    def _step_ahead(self, batch: Batch) -> None:
        """Async scheduling: issue the step, then land the one before it while this one runs on the device."""
        started = time.perf_counter()
        issued = self._launch(batch)
        if issued is None:
            return self._step(batch)
        overlapped = self._inflight is not None
        self.scheduler.launched(batch)
        self._land()
        self._inflight = (batch, issued)
        self._observe(batch, started, overlapped)

    def _observe(self, batch: Batch | None, started: float, overlapped: bool = False) -> None:
        elapsed = time.perf_counter() - started
        for observer in self.observers:
            observer.observe(self.name, batch, elapsed, overlapped)

    def _launch(self, batch: Batch) -> Any:
        """Issue a step without waiting for it; None if that raised (it then runs on its own, isolating failures)."""
        try:
            return self.ahead.launch(batch)
        except Exception as exc:
            log.warning("%s: issuing a batch of %d failed (%s); running it again on its own", self.name,
                        len(batch.requests), exc)
            return None

    def _land(self) -> None:
        """The step in flight, if any: wait for its tokens and apply them."""
        if self._inflight is None:
            return
        (batch, issued), self._inflight = self._inflight, None
        try:
            outputs = self.ahead.collect(issued)
        except Exception as exc:
            log.exception("%s: a step of %d failed on the device", self.name, len(batch.requests))
            self._fail(batch.requests, f"{type(exc).__name__} in {self.name} stage")
            return
        self._apply_step(batch, outputs)

    def _apply_step(self, batch: Batch, outputs: list[RowOutput]) -> None:
        """A step's results to the scheduler, then to `on_step`. Messages that came meanwhile are applied first,
        so an abort during the step wins; requests that ended before the step's results came (aborted, or by
        the step before it) report nothing of it."""
        if not batch.requests or not self._drain(block=False):
            return
        live = [not r.status.is_finished for r in batch.requests]
        finished = self.scheduler.update(batch, outputs)
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.on_step(self.name, StepResult([StageOutput(r.request_id, o.token, o.payload)
                                                        for r, o, ok in zip(batch.requests, outputs, live) if ok],
                                                        [_finish(r) for r in finished], self.scheduler.take_cached()))

    def _run_isolating(self, batch: Batch) -> tuple[Batch, list[RowOutput]]:
        """Run a batch; if it raises, retry its halves, so that only the requests that fail on their
        own are failed (with an error event) and the rest of the batch keeps its step."""
        try:
            outputs = self.runner.run(batch)
            if self.stream is not None:
                started = time.perf_counter()
                self.stream.synchronize()  # payloads are complete before another stage reads them
                self._synced_s += time.perf_counter() - started
            return batch, outputs
        except Exception as exc:
            if len(batch.requests) == 1:
                log.exception("%s: step failed for %s", self.name, batch.requests[0].request_id)
                self._fail(batch.requests, f"{type(exc).__name__} in {self.name} stage")
                return Batch([], [], batch.is_prefill), []
            log.warning("%s: a batch of %d failed (%s); retrying its halves", self.name, len(batch.requests), exc)
        half = len(batch.requests) // 2
        parts = [self._run_isolating(Batch(batch.requests[a:b], batch.num_new_tokens[a:b], batch.is_prefill))
                 for a, b in ((0, half), (half, len(batch.requests)))]
        return (Batch([r for b, _ in parts for r in b.requests], [n for b, _ in parts for n in b.num_new_tokens],
                      batch.is_prefill), [o for _, outs in parts for o in outs])

    def _drain(self, block: bool) -> bool:
        """Apply queued messages; False once stop was asked."""
        while not self._stopping:
            try:
                msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            if msg is None:
                self._stopping = True
                break
            self._apply(msg)
            block = False
        return False

    def _apply(self, msg: StageMessage) -> None:
        if msg.command is Command.ADD:
            self.requests[msg.request_id] = msg.payload
            self.scheduler.add(msg.payload)
            return
        req = self.requests.get(msg.request_id)
        if req is None:
            return  # already finished here
        if msg.command is Command.INPUT and self.on_input:
            self.on_input(req, msg.payload)
        elif msg.command is Command.INPUT_DONE and self.on_input_done:
            self.on_input_done(self, req)
        elif msg.command is Command.ABORT:
            self.finish(req, RequestStatus.FINISHED_ABORTED)

    def finish(self, req: StageRequest, status: RequestStatus, error: str | None = None) -> None:
        """End a request outside a step (abort, error, nothing left to do) and report it."""
        self.scheduler.finish(req, status)
        req.error = error
        self.requests.pop(req.request_id, None)
        self.on_step(self.name, StepResult(finished=[_finish(req)]))

    def _fail(self, reqs: list[StageRequest], error: str) -> None:
        for req in reqs:
            if not req.status.is_finished:
                self.finish(req, RequestStatus.FINISHED_ERROR, error)


def _finish(req: StageRequest) -> Finish:
    return Finish(req.request_id, req.status, len(req.output_ids), req.error)


def build_stage(name: str, cfg: EngineConfig, models: LoadedModels, on_step: StepSink) -> Stage:
    """Stage `name` of the models' graph, in this process, reporting its steps to `on_step`."""
    parts, sc = models.graph.node(name).build(cfg, models), cfg.stage(name)
    if sc.async_scheduling and not parts.runner.can_schedule_ahead:
        raise ProfileError(f"stages[{sc.stage_id}].async_scheduling: the {name} stage cannot issue a step before "
                           "the last one's tokens reach the host (its model reads them there, or a grammar must)")
    observers = (StepLog(cfg.step_log),) if cfg.step_log else ()
    return Stage(name, parts, on_step, models.platform, sc.async_scheduling, observers)
