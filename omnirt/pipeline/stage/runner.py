"""The runner of an autoregressive stage: its model's forward, then sampling, with the step's results brought
to the host in one copy (`launch` issues a step, `collect` waits for it, so that a stage with async scheduling
issues the next step in between)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from omnirt.pipeline.stage.grammar import GrammarMasks
from omnirt.pipeline.stage.pinned import Fetch, PinnedBuffers
from omnirt.pipeline.stage.protocols import StepModel
from omnirt.pipeline.stage.sampling import Sampler
from omnirt.pipeline.stage.step import Batch, RowOutput


class ARRunner:
    """An autoregressive model plus its sampler: sample where the model produced logits, let the model
    build the step's hand-off payloads from the sampled tokens while they are still on the device
    (`complete(requests, outputs, sampled rows, tokens)`, once per batch), then bring the tokens to the host.
    A payload the model left as a device tensor comes back with them (one wait per step, not two).
    `launch` issues a step and starts those copies; `collect` waits for them, so that a stage with async
    scheduling issues the next step in between."""

    def __init__(self, model: StepModel, sampler: Sampler, masks: GrammarMasks | None = None):
        self.model = model
        self.sampler = sampler
        self.masks = masks  # constrained decoding (requests with a `constraint`); None: the stage has none
        self.waited_s = 0.0  # seconds waiting for the device's sampled tokens
        self.pinned = PinnedBuffers(model.device)
        # a step may be issued before the last one's tokens reach the host: the model takes its input tokens from
        # the device and no grammar has to see them first
        self.can_schedule_ahead = model.reads_device_tokens and masks is None

    def run(self, batch: Batch) -> list[RowOutput]:
        return self.collect(self.launch(batch))

    @torch.inference_mode()  # the models' buffers (their pinned buffers too) are inference tensors
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
        for o, payload in zip(outs, self.model.complete(batch.requests, outs, rows, tokens)):
            o.payload = payload
        carried = [i for i, o in enumerate(outs) if isinstance(o.payload, torch.Tensor)]
        values = ([tokens] if rows else []) + ([torch.stack([outs[i].payload for i in carried])] if carried else [])
        return InFlight(outs, rows, carried, constraints, self.pinned.start_fetch(*values))

    def collect(self, step: InFlight) -> list[RowOutput]:
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

    outputs: list[RowOutput]
    rows: list[int]  # the outputs that sampled a token
    carried: list[int]  # the outputs whose payload is a device tensor coming back with the tokens
    constraints: list[Any]  # the sampled rows' grammars, to advance once the tokens are known
    fetch: Fetch
