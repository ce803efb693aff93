"""A stage: scheduler + model runner + a step loop on its own thread.

The loop body is three calls, `schedule()` -> `runner.run(batch)` -> `scheduler.update()`; inputs
(new requests, upstream chunks, aborts) arrive through a queue and are applied between steps,
so aborts that land during a forward take effect before its results are applied. The loop never
does IO: each step's `StepResult` goes to `on_step`, which routes it along the model's stage graph.
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

from pipeline.connector import Command, StageMessage
from pipeline.grammar import GrammarMasks
from pipeline.request import Finish, Output, RequestStatus, StageRequest, StepResult
from pipeline.sampling import Sampler
from pipeline.scheduler import Batch, StepOutput

log = logging.getLogger(__name__)



StepSink = Callable[[str, StepResult], None]  # (stage name, what its step produced)


class ARRunner:
    """An autoregressive model plus its sampler: sample where the model produced logits, let the model
    build the step's hand-off payloads from the sampled tokens while they are still on the device
    (`complete(requests, outputs, sampled rows, tokens)`, once per batch), then bring the tokens to the host.
    A payload the model left as a device tensor comes back with them (one wait per step, not two)."""

    def __init__(self, model: Any, sampler: Sampler, masks: GrammarMasks | None = None):
        self.model = model
        self.sampler = sampler
        self.masks = masks  # constrained decoding (requests with a `constraint`); None: the stage has none
        self.waited_s = 0.0  # seconds waiting for the device's sampled tokens

    def run(self, batch: Batch) -> list[StepOutput]:
        outs = self.model.run(batch)
        rows = [i for i, o in enumerate(outs) if o.logits is not None]
        reqs = [batch.requests[i] for i in rows]
        constraints = [r.constraint for r in reqs]
        tokens = None
        if rows:  # the masks are filled on the host while the device computes the logits
            bitmask = self.masks.fill(constraints) if self.masks is not None else None
            tokens = self.sampler(torch.stack([outs[i].logits for i in rows]), [r.sampling for r in reqs],
                                  [r.output_ids for r in reqs], [r.generator for r in reqs], [r.slot for r in reqs],
                                  bitmask)
        complete = getattr(self.model, "complete", None)
        if complete is not None:
            for o, payload in zip(outs, complete(batch.requests, outs, rows, tokens)):
                o.payload = payload
        self._fetch(outs, rows, tokens)
        if rows and self.masks is not None:
            self.masks.accept(constraints, [outs[i].token for i in rows])
        return outs

    def _fetch(self, outs: list[StepOutput], rows: list[int], tokens: torch.Tensor | None) -> None:
        """The sampled tokens, and the payloads that are device tensors, to the host in one wait."""
        carried = [i for i, o in enumerate(outs) if isinstance(o.payload, torch.Tensor)]
        values = ([tokens] if rows else []) + ([torch.stack([outs[i].payload for i in carried])] if carried else [])
        if not values:
            return
        started = time.perf_counter()
        fetched = self.sampler.fetch(*values)
        self.waited_s += time.perf_counter() - started
        fetched = fetched if len(values) > 1 else [fetched]
        for i, t in zip(rows, fetched[0] if rows else ()):
            outs[i].token = t
        for i, p in zip(carried, fetched[-1] if carried else ()):
            outs[i].payload = p


class Stage:
    def __init__(self, name: str, scheduler: Any, runner: Any, on_step: StepSink,
                 on_input: Callable[[StageRequest, Any], None] | None = None,
                 on_input_done: Callable[[Stage, StageRequest], None] | None = None, stream: Any = None):
        self.name = name
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
        while True:
            if not self._drain(block=False):
                return
            batch = self.scheduler.schedule()
            if batch is None or not batch.requests:
                if not self._drain(block=True):
                    return
                continue
            self._step(batch)

    def _step(self, batch: Batch) -> None:
        self.batch_size_counts[len(batch.requests)] += 1
        started = time.perf_counter()
        batch, outputs = self._run_isolating(batch)
        elapsed = time.perf_counter() - started
        self.busy_s += elapsed
        if not batch.is_prefill:
            self.decode_busy_s += elapsed
            self.num_decode_steps += 1
        if not batch.requests or not self._drain(block=False):
            return
        finished = self.scheduler.update(batch, outputs)
        self.num_steps += 1
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.on_step(self.name, StepResult([Output(r.request_id, o.token, o.payload)
                                            for r, o in zip(batch.requests, outputs)],
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
        while True:
            try:
                msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            if msg is None:
                return False
            self._apply(msg)
            block = False

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
    parts = models.graph.node(name).build(cfg, models)
    return Stage(name, parts.scheduler, parts.runner, on_step, parts.on_input, parts.on_input_done,
                 stream=models.platform.stage_stream())
