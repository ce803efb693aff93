"""A stage: scheduler + model runner + a step loop on its own thread.

The loop body is `schedule()` -> `runner.run(batch)` -> `scheduler.launched(batch)` ->
`scheduler.update()`; inputs (new requests, upstream chunks, aborts) arrive through a queue and are
applied between steps, so aborts that land during a forward take effect before its results are applied.
The loop never does IO: each step's `StepResult` goes to `on_step`, which routes it along the model's
stage graph.

With async scheduling (a stage's `async_scheduling`, where its runner can: the model reads its input tokens
on the device), step n+1 is scheduled and issued before step n's tokens come to the host, and step n lands
(its results applied and routed) while n+1 runs: the host's per-step work overlaps the device's instead of
alternating with it. A request then has at most one token in flight; the scheduler lets it step again
unless that token is sure to end it, and a step issued after a token that does end it (EOS) is void.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.config import ProfileError
from pipeline.stage.grammar import GrammarMasks
from pipeline.stage.messages import Command, StageMessage
from pipeline.stage.pinned import Fetch, HostStaging
from pipeline.stage.request import Finish, Output, RequestStatus, StageRequest, StepResult
from pipeline.stage.sampling import Sampler
from pipeline.stage.scheduler import Batch, StepOutput

log = logging.getLogger(__name__)



StepSink = Callable[[str, StepResult], None]  # (stage name, what its step produced)


class ARRunner:
    """An autoregressive model plus its sampler: sample where the model produced logits, let the model
    build the step's hand-off payloads from the sampled tokens while they are still on the device
    (`complete(requests, outputs, sampled rows, tokens)`, once per batch), then bring the tokens to the host.
    A payload the model left as a device tensor comes back with them (one wait per step, not two).
    `launch` issues a step and starts those copies; `collect` waits for them, so that a stage with async
    scheduling issues the next step in between."""

    def __init__(self, model: Any, sampler: Sampler, masks: GrammarMasks | None = None):
        self.model = model
        self.sampler = sampler
        self.masks = masks  # constrained decoding (requests with a `constraint`); None: the stage has none
        self.waited_s = 0.0  # seconds waiting for the device's sampled tokens
        self.staging = HostStaging(model.device)

    @property
    def can_schedule_ahead(self) -> bool:
        """A step may be issued before the last one's tokens reach the host: the model takes its input tokens
        from the device (`reads_device_tokens`) and no grammar has to see them first."""
        return getattr(self.model, "reads_device_tokens", False) and self.masks is None

    def run(self, batch: Batch) -> list[StepOutput]:
        return self.collect(self.launch(batch))

    @torch.inference_mode()  # the models' buffers (their staging too) are inference tensors
    def launch(self, batch: Batch) -> InFlight:
        outs = self.model.run(batch)
        rows = [i for i, o in enumerate(outs) if o.logits is not None]
        reqs = [batch.requests[i] for i in rows]
        constraints = [r.constraint for r in reqs]
        tokens = None
        if rows:  # the masks are filled on the host while the device computes the logits
            bitmask = self.masks.fill(constraints) if self.masks is not None else None
            tokens = self.sampler(torch.stack([outs[i].logits for i in rows]), [r.sampling for r in reqs],
                                  [r.output_ids for r in reqs], [r.generator for r in reqs], [r.slot for r in reqs],
                                  bitmask, [r.num_pending for r in reqs])
        complete = getattr(self.model, "complete", None)
        if complete is not None:
            for o, payload in zip(outs, complete(batch.requests, outs, rows, tokens)):
                o.payload = payload
        carried = [i for i, o in enumerate(outs) if isinstance(o.payload, torch.Tensor)]
        values = ([tokens] if rows else []) + ([torch.stack([outs[i].payload for i in carried])] if carried else [])
        return InFlight(outs, rows, carried, constraints, self.staging.start_fetch(*values))

    def collect(self, step: InFlight) -> list[StepOutput]:
        """The step's sampled tokens, and its payloads that are device tensors, on the host (one wait)."""
        started = time.perf_counter()
        fetched = step.fetch.wait()
        self.waited_s += time.perf_counter() - started
        outs, rows, carried = step.outputs, step.rows, step.carried
        fetched = fetched if rows and carried else [fetched]
        for i, t in zip(rows, fetched[0] if rows else ()):
            outs[i].token = t
        for i, p in zip(carried, fetched[-1] if carried else ()):
            outs[i].payload = p
        if rows and self.masks is not None:
            self.masks.accept(step.constraints, [outs[i].token for i in rows])
        return outs


@dataclass(slots=True)
class InFlight:
    """A step issued to the device whose tokens (and device payloads) are on their way to the host."""

    outputs: list[StepOutput]
    rows: list[int]  # the outputs that sampled a token
    carried: list[int]  # the outputs whose payload is a device tensor coming back with the tokens
    constraints: list[Any]  # the sampled rows' grammars, to advance once the tokens are known
    fetch: Fetch


class Stage:
    def __init__(self, name: str, scheduler: Any, runner: Any, on_step: StepSink,
                 on_input: Callable[[StageRequest, Any], None] | None = None,
                 on_input_done: Callable[[Stage, StageRequest], None] | None = None, stream: Any = None,
                 schedules_ahead: bool = False, step_log: str | None = None):
        self.name = name
        # one line per step, appended whole (several stages, and worker processes, share the file)
        self._step_log = open(step_log, "a", buffering=1) if step_log else None  # closed in stop()
        self.schedules_ahead = schedules_ahead  # async scheduling: issue step n+1 before step n's tokens land
        self._inflight: tuple[Batch, InFlight] | None = None  # the step issued and not yet landed
        self._stopping = False
        self.stream = stream  # the device stream this stage's kernels go to (None: the CPU)
        self.scheduler = scheduler
        self.runner = runner
        self.on_step = on_step
        self.on_input = on_input  # apply an upstream chunk to a request's state
        self.on_input_done = on_input_done
        self.requests: dict[str, StageRequest] = {}
        self.num_steps = 0
        self.batch_size_counts = [0] * (scheduler.max_num_seqs + 1)  # steps per batch size, for /metrics
        self.busy_s = 0.0  # seconds inside steps (host work + waiting for the device), for /metrics
        self.decode_busy_s = 0.0  # the part of busy_s in decode steps (the rest: prefill chunks)
        self.num_decode_steps = 0
        self.num_steps_ahead = 0  # steps issued while the one before was still in flight (async scheduling)
        self._synced_s = 0.0  # waiting for the stream at the end of steps
        self._inbox: queue.SimpleQueue[StageMessage | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"omnirt-{name}", daemon=True)

    @property
    def device_wait_s(self) -> float:
        """The part of busy_s spent waiting for the device (for the sampled tokens, and at the end of steps)."""
        return self._synced_s + getattr(self.runner, "waited_s", 0.0)

    @property
    def num_free_slots(self) -> int:
        kv = getattr(self.scheduler, "kv", None)
        return kv.num_free_slots if kv is not None else 0

    @property
    def num_slots(self) -> int:
        kv = getattr(self.scheduler, "kv", None)
        return kv.num_slots if kv is not None else 0

    def prefix_stats(self) -> tuple[int, int, int, int]:
        """(prompt tokens prefilled, prompt tokens reused, resident slots, bytes they keep beyond the KV)."""
        kv = getattr(self.scheduler, "kv", None)
        if kv is None:
            return 0, 0, 0, 0
        held = list(kv.resident.values())
        return (self.scheduler.num_prefill_tokens, self.scheduler.num_cached_tokens, len(held),
                sum(h.num_bytes for h in held))

    # ---- called from other threads ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)
        if self._step_log is not None:
            self._step_log.close()

    def send(self, msg: StageMessage) -> None:
        self._inbox.put(msg)

    def send_inputs(self, items: list[tuple[str, object]]) -> None:
        """One upstream step's chunks, for several requests."""
        for rid, payload in items:
            self._inbox.put(StageMessage(Command.INPUT, rid, payload))

    # ---- the stage thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self._run_loop()

    def _run_loop(self) -> None:
        while self._drain(block=False):
            batch = self.scheduler.schedule()
            if batch is not None and batch.requests:
                self._step(batch)
            elif self._inflight is not None:  # nothing new to issue: the step in flight lands
                started = time.perf_counter()
                self._land()
                self.busy_s += time.perf_counter() - started
            elif not self._drain(block=True):
                return

    def _step(self, batch: Batch) -> None:
        """Run a step. With async scheduling it is issued, and the step before it lands (its tokens to the
        host, its results applied and routed) while this one runs on the device; otherwise it runs to its end
        and lands at once."""
        self.batch_size_counts[len(batch.requests)] += 1
        started = time.perf_counter()
        issued = self._launch(batch) if self.schedules_ahead else None
        if issued is None:
            self._land()
            batch, outputs = self._run_isolating(batch)
            self.scheduler.launched(batch)
            self._apply_step(batch, outputs)
        else:
            self.scheduler.launched(batch)
            self.num_steps_ahead += self._inflight is not None
            self._land()
            self._inflight = (batch, issued)
        elapsed = time.perf_counter() - started
        self.busy_s += elapsed
        if self._step_log is not None:
            self._log_step(batch, elapsed)
        if not batch.is_prefill:
            self.decode_busy_s += elapsed
            self.num_decode_steps += 1

    def _log_step(self, batch: Batch, elapsed: float) -> None:
        """`--step-log`: wall-clock time, stage, kind, requests, tokens, milliseconds (with async scheduling,
        the time to issue this step and land the one before)."""
        kind = "prefill" if batch.is_prefill else "decode"
        self._step_log.write(f"{time.time():.4f} {self.name} {kind} {len(batch.requests)} "
                             f"{sum(batch.num_new_tokens)} {elapsed * 1000:.2f}\n")

    def _launch(self, batch: Batch) -> InFlight | None:
        """Issue a step without waiting for it; None if that raised (it then runs on its own, isolating failures)."""
        try:
            return self.runner.launch(batch)
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
            outputs = self.runner.collect(issued)
        except Exception as exc:
            log.exception("%s: a step of %d failed on the device", self.name, len(batch.requests))
            self._fail(batch.requests, f"{type(exc).__name__} in {self.name} stage")
            return
        self._apply_step(batch, outputs)

    def _apply_step(self, batch: Batch, outputs: list[StepOutput]) -> None:
        """A step's results to the scheduler, then to `on_step`. Messages that came meanwhile are applied first,
        so an abort during the step wins; requests that ended before the step's results came (aborted, or by
        the step before it) report nothing of it."""
        if not batch.requests or not self._drain(block=False):
            return
        live = [not r.status.is_finished for r in batch.requests]
        finished = self.scheduler.update(batch, outputs)
        self.num_steps += 1
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.on_step(self.name, StepResult([Output(r.request_id, o.token, o.payload)
                                            for r, o, ok in zip(batch.requests, outputs, live) if ok],
                                           [_finish(r) for r in finished], self._new_hits()))

    def _new_hits(self) -> list[tuple[str, int]]:
        """The scheduler's prefix hits since the last report (request id, prompt tokens reused)."""
        hits = getattr(self.scheduler, "cached", None)
        if not hits:
            return []
        out = list(hits)
        hits.clear()
        return out

    def _run_isolating(self, batch: Batch) -> tuple[Batch, list[StepOutput]]:
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

    @property
    def num_waiting(self) -> int:
        """Requests here without a slot yet, plus messages not yet applied (read from other threads)."""
        return self.scheduler.num_waiting + self._inbox.qsize()

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


def build_stage(name: str, cfg: Any, models: Any, on_step: StepSink) -> Stage:
    """Stage `name` of the models' graph, in this process, reporting its steps to `on_step`."""
    parts, sc = models.graph.node(name).build(cfg, models), cfg.stage(name)
    if sc.async_scheduling and not getattr(parts.runner, "can_schedule_ahead", False):
        raise ProfileError(f"stages[{sc.stage_id}].async_scheduling: the {name} stage cannot issue a step before "
                           "the last one's tokens reach the host (its model reads them there, or a grammar must)")
    return Stage(name, parts.scheduler, parts.runner, on_step, parts.on_input, parts.on_input_done,
                 stream=models.platform.stage_stream(), schedules_ahead=sc.async_scheduling, step_log=cfg.step_log)
