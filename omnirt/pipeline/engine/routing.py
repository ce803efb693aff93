"""Routing step results along the stage graph, on the stage threads: each stage's `StepResult` goes where the
model's graph says. Outputs that mean something to the client go to the request's reply stream, payloads to
the next stage on the request's path (one hand-off per step and next stage), and a request's end in a stage to
the next stage or, from the last, to the close of its reply. Request state itself (the stream table,
admission) changes on the event loop only (`close_soon`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from omnirt.pipeline.engine.output import ReplyStream
from omnirt.pipeline.engine.timeline import FirstOutputTimes
from omnirt.pipeline.stage.graph import StageGraph
from omnirt.pipeline.stage.messages import Command, StageMessage
from omnirt.pipeline.stage.protocols import StageHandle
from omnirt.pipeline.stage.request import FINISH_REASONS, RequestStatus
from omnirt.pipeline.stage.step import Finish, StepResult

CloseSoon = Callable[[ReplyStream, str | None, str | None], None]  # (stream, finish reason, error)


class StepRouter:
    def __init__(self, graph: StageGraph, streams: dict[str, ReplyStream], stages: dict[str, StageHandle],
                 close_soon: CloseSoon):
        self.graph, self.streams, self.stages, self.close_soon = graph, streams, stages, close_soon
        self.first_outputs = {name: FirstOutputTimes() for name in graph.names}  # one writer each: its stage

    def on_step(self, stage: str, result: StepResult) -> None:
        node, handoffs, now = self.graph.node(stage), {}, time.perf_counter()
        if stage == self.graph.names[0]:  # the first stage's prefix hits are the request's cached tokens
            for rid, n in result.cached:
                if (stream := self.streams.get(rid)) is not None:
                    stream.num_cached_tokens = n
        for out in result.outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            item = node.to_client(out)
            if item is not None:
                stream.push(item)
            if (out.token is not None or item is not None) and stage not in stream.served_by:
                stream.served_by.add(stage)  # one thread per stage: no two threads add the same name
                self.first_outputs[stage].observe(now - stream.submitted_at)
            if out.payload is not None:
                nxt = self.graph.next_stage(stage, stream.request.wants_audio)
                if nxt is not None:
                    handoffs.setdefault(nxt, []).append((out.request_id, out.payload))
                if node.counts_audio_frames:
                    stream.num_audio_frames += 1
        for nxt, items in handoffs.items():
            self.stages[nxt].send_inputs(items)
        for fin in result.finished:
            stream = self.streams.get(fin.request_id)
            if stream is not None and not self._failed(fin, stream):
                self._finished_in(stage, fin, stream)

    def _finished_in(self, stage: str, fin: Finish, stream: ReplyStream) -> None:
        """The request is done in `stage`: the first stage's end is the reply's; the last one closes it."""
        if stage == self.graph.names[0]:
            stream.finish_reason = FINISH_REASONS[fin.status]
            stream.num_completion_tokens = fin.num_output_tokens
        nxt = self.graph.next_stage(stage, stream.request.wants_audio)
        if nxt is not None:
            self.stages[nxt].send(StageMessage(Command.INPUT_DONE, fin.request_id))
        else:
            self.close_soon(stream, None, None)

    def _failed(self, fin: Finish, stream: ReplyStream) -> bool:
        """Aborted or errored: the request ends in every stage, with one Finished event."""
        if fin.status is RequestStatus.FINISHED_ABORTED:
            return True
        if fin.status is RequestStatus.FINISHED_ERROR:
            for handle in self.stages.values():
                handle.send(StageMessage(Command.ABORT, fin.request_id))
            self.close_soon(stream, "error", fin.error)
            return True
        return False
