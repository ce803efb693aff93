"""OmniEngine: submit / stream / abort over the model's stage graph (Thinker -> Talker -> Code2Wav for
Qwen3-Omni, declared in its model package).

The engine is asyncio-facing; each stage steps on its own thread. Stage threads report one typed
`StepResult` per step, which the router (`routing.py`) sends along the graph: hand-off payloads to the next
stage, raw results (token ids, PCM) to the request's reply stream; detokenisation and event shaping happen
on the consumer's side, off the decode loops (async output). Request state (the stream table, admission)
changes on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

import msgspec

from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.engine.admission import Admission
from omnirt.pipeline.engine.detokenizer import IncrementalDetokenizer
from omnirt.pipeline.engine.output import BlockingReplyStream, ReplyStream
from omnirt.pipeline.engine.routing import StepRouter
from omnirt.pipeline.engine.rules import RequestRules
from omnirt.pipeline.engine.text_events import TextEvents
from omnirt.pipeline.platform import get_platform
from omnirt.pipeline.replicas.pool import make_stage
from omnirt.pipeline.stage.grammar import Constraint, ConstraintError
from omnirt.pipeline.stage.graph import AudioPcm, LoadedModels, TextTokens
from omnirt.pipeline.stage.messages import Command, StageMessage
from omnirt.pipeline.stage.protocols import StageHandle
from omnirt.pipeline.types import (
    AudioChunk,
    EngineInfo,
    EngineStats,
    Event,
    Finished,
    OmniRequest,
    RequestError,
    StageLimit,
    StageStats,
    Usage,
)

log = logging.getLogger(__name__)


class OmniEngine:
    def __init__(self, cfg: EngineConfig, models: LoadedModels):
        self.cfg, self.models, self.graph = cfg, models, models.graph
        self.rules = RequestRules(cfg, models)
        self._streams: dict[str, ReplyStream] = {}
        self._starting: dict[str, str | None] = {}  # submitted, not yet admitted: an abort that came meanwhile
        self._stream_type = ReplyStream if cfg.async_output else BlockingReplyStream
        self.admission = Admission({n: StageLimit(cfg.stage(n).max_num_seqs, cfg.stage(n).max_waiting)
                                    for n in self.graph.names}, cfg.retry_after_s)
        self._by_name: dict[str, StageHandle] = {}
        self.router = StepRouter(self.graph, self._streams, self._by_name, self._close_soon)
        self.stages = [make_stage(name, cfg, models, self.router.on_step) for name in self.graph.names]
        self._by_name.update((s.name, s) for s in self.stages)

    def stage(self, name: str) -> StageHandle:
        return self._by_name[name]

    # ---- lifecycle and what the engine tells about itself -------------------------------------------------

    def start(self) -> None:
        self.models.capture_cuda_graphs()
        for stage in self.stages:
            stage.start()

    def stop(self) -> None:
        for stage in self.stages:
            stage.stop()

    def info(self) -> EngineInfo:
        return self.rules.info("omnirt")

    def num_free_slots(self) -> dict[str, int]:
        """Per stage with a KV cache, the slots a new request could take (resident ones included)."""
        return {s.name: s.num_free_slots for s in self.stages if self.graph.node(s.name).needs_kv}

    def num_slots(self) -> dict[str, int]:
        return {s.name: s.num_slots for s in self.stages if self.graph.node(s.name).needs_kv}

    def replica_status(self) -> dict[str, list[dict]]:
        """Per stage, each replica's state and load (for /health and metrics)."""
        return {s.name: s.replica_status() for s in self.stages}

    def stats(self) -> EngineStats:
        """Queues, slots, batch sizes and step times, read without stopping the step loops."""
        return EngineStats(len(self._streams), [self._stage_stats(s) for s in self.stages],
                           self.admission.num_refused, self.replica_status(),
                           get_platform(self.cfg.platform).allocator_counters())

    def _stage_stats(self, stage: StageHandle) -> StageStats:
        """What the stage reports, with what the engine knows of it: its admission queue, and when requests got
        their first output from it (the engine times those)."""
        counts, sum_s = self.router.first_outputs[stage.name].snapshot()
        return msgspec.structs.replace(stage.stats(), admission_waiting=self.admission.num_waiting(stage.name),
                                       first_output_counts=counts, first_output_s=sum_s)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    # ---- the API ---------------------------------------------------------------------------------------

    def submit(self, req: OmniRequest) -> Awaitable[AsyncIterator[Event]]:
        """Validate and start `req`; awaiting it gives the stream of its events (ending with `Finished`).
        Raises RequestError before anything starts when the request cannot be served. The request counts
        from this call on: an abort that comes while its prompt is being encoded still ends it."""
        if req.request_id in self._streams or req.request_id in self._starting:
            raise RequestError(f"request id {req.request_id!r} is already running", "request_id")
        self._starting[req.request_id] = None
        return self._start(req, time.perf_counter())

    async def _start(self, req: OmniRequest, submitted_at: float) -> AsyncIterator[Event]:
        try:
            stream = await self._admit(req, submitted_at)
        finally:
            early_abort = self._starting.pop(req.request_id, None)
        if early_abort is not None:
            self.abort(req.request_id, early_abort or None)
        return self._events(stream)

    async def _admit(self, req: OmniRequest, submitted_at: float) -> ReplyStream:
        rules = self.rules
        voice = rules.check_voice(req)
        tools = rules.prompt_tools(req)
        prompt = await asyncio.to_thread(self._encode, req, tools)
        messages, dropped = (rules.truncated(req, prompt.message_tokens) if req.truncation is not None
                             else (req.messages, 0))
        if dropped:
            prompt = await asyncio.to_thread(self.models.encoder.encode, messages, tools)
        constraint = None if req.prefill_only else await self._compiled(req)
        n_prompt = len(prompt.input_ids)
        params = rules.all_params(req, n_prompt)
        if req.prefill_only:  # its one sampled token is dropped (`_events`) and never fed: the slot holds the prompt
            params = {name: p.merged(max_tokens=1) for name, p in params.items()}
        path = self.graph.path(req.wants_audio)
        stream = self._stream_type(req, asyncio.get_running_loop(), n_prompt, path, self.cfg.max_output_buffer_bytes,
                                   self._overflow, dropped, submitted_at)
        stream.num_prompt_audio_tokens = prompt.num_audio_tokens
        stream.num_prompt_image_tokens = prompt.num_image_tokens
        self.admission.admit(path)  # raises EngineOverloaded when a stage's wait queue is full
        self._streams[req.request_id] = stream
        try:
            first = self.graph.new_requests(self.models, self.cfg, req, prompt, voice, params)
            first[path[0]].constraint = constraint
            for name in reversed(path):  # downstream stages know the request before its first hand-off
                self.stage(name).send(StageMessage(Command.ADD, req.request_id, first[name]))
        except BaseException:
            self.abort(req.request_id)  # never leave a half-started request holding its admission
            raise
        return stream

    def _encode(self, req: OmniRequest, tools: list[dict]):
        """The prompt; a `prefill_only` request's stops inside the audio still being spoken (RequestError while
        none of it is settled)."""
        if not req.prefill_only:
            return self.models.encoder.encode(req.messages, tools)
        prompt = self.models.encoder.encode_settled(req.messages, tools)
        if prompt is None:
            raise RequestError("nothing to prefill yet: the last audio holds no settled encoder window "
                               "(EngineInfo.num_settled_windows)", "messages")
        return prompt

    async def _compiled(self, req: OmniRequest) -> Constraint | None:
        """The request's grammar, compiled in a worker thread (cached by spec), never on a stage's step path."""
        if not self.rules.is_constrained(req):
            return None
        try:
            return await asyncio.to_thread(lambda: self.models.grammars.compile(self.rules.constraint_spec(req)))
        except ConstraintError as exc:
            raise RequestError(str(exc), "tools" if self.rules.forces_calls(req) else "response_format",
                               "invalid_schema") from exc

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Free the request in every stage; its stream ends with finish_reason "abort" (and `error`,
        the reason, when the server rather than the client ended it)."""
        if request_id in self._starting:  # still being encoded: ended as soon as it is admitted
            self._starting[request_id] = error or ""
        stream = self._streams.get(request_id)
        for stage in self.stages:
            stage.send(StageMessage(Command.ABORT, request_id))
        if stream is not None:
            self._close(stream, "abort", error)

    def abort_all(self, error: str) -> None:
        for rid in list(self._streams):
            self.abort(rid, error)

    def check_admission(self, wants_audio: bool = True) -> None:
        """Raise EngineOverloaded if a new request would be refused now (e.g. to refuse a session at connect)."""
        self.admission.check(self.graph.path(wants_audio))

    def _overflow(self, stream: ReplyStream) -> None:
        log.warning("%s: output buffer over %d bytes (the client is not reading); aborting",
                    stream.request.request_id, stream.max_buffered_bytes)
        self.abort(stream.request.request_id, "output buffer full: the client is not reading")

    async def _events(self, stream: ReplyStream) -> AsyncIterator[Event]:
        """The reply's items as client events: text detokenised (tool calls parsed out), audio numbered."""
        rid, index, pending = stream.request.request_id, 0, []
        detok = IncrementalDetokenizer(self.models.tokenizer)
        text_out = TextEvents(rid, self.models.tool_parser() if self.rules.prompt_tools(stream.request) else None)
        try:
            while True:
                match await stream.get():
                    case TextTokens() if stream.request.prefill_only:
                        pass
                    case TextTokens(token_ids=ids):
                        pending.extend(ids)
                        text = detok.add(ids)
                        if text:  # else an incomplete UTF-8 sequence: wait for the next token
                            for ev in text_out.feed(text, pending):
                                yield ev
                            pending = []
                    case AudioPcm(pcm16=pcm):
                        yield AudioChunk(rid, pcm, index)
                        index += 1
                    case Finished() as fin:  # with the text held back (an incomplete UTF-8 tail, a tool call's start)
                        for ev in text_out.feed(detok.flush() if pending else "", pending, final=True):
                            yield ev
                        yield text_out.finished(fin)
                        return
        finally:
            if not stream.closed:
                self.abort(rid)

    # ---- closing a reply (on the event loop) ------------------------------------------------------------

    def _close_soon(self, stream: ReplyStream, reason: str | None = None, error: str | None = None) -> None:
        """From a stage thread: close on the event loop, after the outputs already pushed. Request state
        (the stream table, admission) changes on the loop's thread only, so a finish racing an abort
        releases admission once."""
        stream.loop.call_soon_threadsafe(self._close, stream, reason, error)

    def _close(self, stream: ReplyStream, reason: str | None = None, error: str | None = None) -> None:
        """On the event loop only."""
        if stream.closed:
            return
        stream.closed = True
        self._streams.pop(stream.request.request_id, None)
        self.admission.release(stream.stages)
        completion = 0 if stream.request.prefill_only else stream.num_completion_tokens
        usage = Usage(stream.num_prompt_tokens, completion, stream.num_audio_frames,
                      stream.num_cached_tokens, stream.num_prompt_audio_tokens, stream.num_prompt_image_tokens)
        stream.put(Finished(stream.request.request_id, reason or stream.finish_reason, usage, error,
                            stream.truncated_messages))
