"""OmniEngine: submit / stream / abort over the model's stage graph (Thinker -> Talker -> Code2Wav for
Qwen3-Omni, declared in its model package).

The engine is asyncio-facing; each stage steps on its own thread. Stage threads report one typed
`StepResult` per step, which the engine routes along the graph: hand-off payloads to the next
stage, raw results (token ids, PCM) to the request's queue; detokenisation and event shaping happen
on the consumer's side, off the decode loops (async output). Request state (the stream table,
admission) changes on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable

from pipeline.config import EngineConfig
from pipeline.engine.admission import Admission
from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.engine.output import RequestOutput
from pipeline.engine.text_events import TextEvents
from pipeline.engine.timeline import FirstOutputTimes
from pipeline.models.qwen3_omni.models import OmniModels
from pipeline.platform import get_platform
from pipeline.replicas.pool import make_stage, replica_status
from pipeline.stage.grammar import Constraint, ConstraintError, response_format_spec
from pipeline.stage.loop import Stage
from pipeline.stage.messages import Command, StageMessage
from pipeline.stage.request import FINISH_REASONS, Finish, RequestStatus, StepResult
from pipeline.stage.sampling import SamplingError, SamplingParams, numerically_safe
from pipeline.types import (
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


class EngineBase:
    """What every engine behind the API shares: config, models, and request validation."""

    kind = "omnirt"

    def __init__(self, cfg: EngineConfig, models: OmniModels):
        self.cfg, self.models = cfg, models

    @property
    def voices(self) -> list[str]:
        return sorted(self.models.voices)

    def info(self) -> EngineInfo:
        graph = self.models.graph
        limits = {n: StageLimit(self.cfg.stage(n).max_num_seqs, self.cfg.stage(n).max_waiting) for n in graph.names}
        return EngineInfo(self.cfg.model, tuple(self.voices), self.cfg.default_voice, self.cfg.system_prompt,
                          graph.has_audio_output, self.models.input_sample_rate,
                          self.models.output_sample_rate, limits, self.cfg.retry_after_s,
                          self.cfg.max_output_buffer_bytes, self.kind, self.cfg.platform, self.cfg.voice_aliases)

    def check_admission(self, wants_audio: bool = True) -> None:
        """Raise EngineOverloaded when new work would have to wait past the stages' bounds (none here)."""

    def _check_voice(self, req: OmniRequest) -> str | None:
        if not req.wants_audio:
            return None
        if not self.models.graph.has_audio_output:
            raise RequestError("this model has no audio output", "modalities")
        voice = (req.voice or self.cfg.default_voice).lower()
        voice = self.cfg.voice_aliases.get(voice, voice)
        if voice not in self.models.voices:
            aliases = f" (or {', '.join(self.cfg.voice_aliases)})" if self.cfg.voice_aliases else ""
            raise RequestError(f"unknown voice {req.voice!r}; available: {', '.join(self.voices)}{aliases}", "voice",
                               "invalid_voice")
        return voice

    @staticmethod
    def _prompt_tools(req: OmniRequest) -> list[dict]:
        """The tools the prompt lists: none with tool_choice "none", so the model cannot call one."""
        return [] if req.tool_choice == "none" else req.tools

    @staticmethod
    def _forces_calls(req: OmniRequest) -> bool:
        return bool(req.tools) and req.tool_choice not in ("auto", "none")

    def _is_constrained(self, req: OmniRequest) -> bool:
        return self._forces_calls(req) or response_format_spec(req.response_format) is not None

    def _constraint_spec(self, req: OmniRequest) -> dict | None:
        """The grammar the reply must follow: forced tool calls, else the response format, else none."""
        if self._forces_calls(req):
            return self.models.tool_call_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
        return response_format_spec(req.response_format)

    def _all_params(self, req: OmniRequest, num_prompt: int) -> dict[str, SamplingParams]:
        """Sampling parameters per stage on the request's path; RequestError if one cannot be served."""
        out = {}
        for name in self.models.graph.path(req.wants_audio):
            node = self.models.graph.node(name)
            if node.sampling_field is not None:
                out[name] = self._params(name, getattr(req, node.sampling_field), num_prompt + node.prefix_tokens)
        return out

    def _prompt_limit(self, req: OmniRequest) -> int:
        """The longest prompt every stage on the request's path can take and still have its output budget:
        the requested (or default) max_tokens, at most a quarter of the stage's context."""
        limits = []
        for name in self.models.graph.path(req.wants_audio):
            node, cfg = self.models.graph.node(name), self.cfg.stage(name)
            if node.sampling_field is not None:
                wanted = getattr(req, node.sampling_field).get("max_tokens")
                budget = wanted if isinstance(wanted, int) and wanted > 0 else \
                    cfg.default_sampling_params.get("max_tokens", SamplingParams().max_tokens)
                limits.append(cfg.max_model_len - node.prefix_tokens - min(budget, cfg.max_model_len // 4))
        return min(limits)

    def _truncated(self, req: OmniRequest, message_tokens: list[int] | None) -> tuple[list[dict], int]:
        """The messages to encode, and how many of the oldest conversation messages (after the leading
        system ones) they leave out so that the prompt fits `req.truncation` of the room left for them;
        never the last message (a prompt whose last message alone does not fit fails as without truncation)."""
        first = _num_leading_system(req.messages)
        if message_tokens is None or len(message_tokens) != len(req.messages) + 1:
            return req.messages, 0  # the rendering's message boundaries are not known: no truncation
        limit = self._prompt_limit(req)
        if sum(message_tokens) <= limit:
            return req.messages, 0
        fixed = sum(message_tokens[:first]) + message_tokens[-1]  # instructions and the assistant header
        target, conversation = req.truncation * (limit - fixed), message_tokens[first:-1]
        dropped, kept = 0, sum(conversation)
        while kept > target and dropped < len(conversation) - 1:
            kept -= conversation[dropped]
            dropped += 1
        return req.messages[:first] + req.messages[first + dropped:], dropped

    def _params(self, stage: str, overrides: dict, num_prompt: int) -> SamplingParams:
        cfg = self.cfg.stage(stage)
        room = cfg.max_model_len - num_prompt
        if room < 1:
            raise RequestError(f"the prompt is {num_prompt} tokens; the {stage} context holds "
                               f"{cfg.max_model_len}", "messages", "context_length_exceeded")
        try:
            params = SamplingParams(**cfg.default_sampling_params).merged(**overrides)
        except (AssertionError, TypeError) as exc:
            raise RequestError(f"bad sampling parameters: {exc}", "sampling") from exc
        try:
            params = numerically_safe(params)
        except SamplingError as exc:
            raise RequestError(str(exc), exc.param) from exc
        return params.merged(max_tokens=min(params.max_tokens, room))


class OmniEngine(EngineBase):
    def __init__(self, cfg: EngineConfig, models: OmniModels):
        super().__init__(cfg, models)
        self.graph = models.graph
        self._streams: dict[str, RequestOutput] = {}
        self._starting: dict[str, str | None] = {}  # submitted, not yet admitted: an abort that came meanwhile
        self.admission = Admission({n: StageLimit(cfg.stage(n).max_num_seqs, cfg.stage(n).max_waiting)
                                    for n in self.graph.names}, cfg.retry_after_s)
        self.stages = [make_stage(name, cfg, models, self._on_step) for name in self.graph.names]
        self._by_name = {s.name: s for s in self.stages}
        self._first_outputs = {name: FirstOutputTimes() for name in self.graph.names}

    def stage(self, name: str):
        return self._by_name[name]

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.models.capture_graphs()
        for stage in self.stages:
            stage.start()

    def stop(self) -> None:
        for stage in self.stages:
            stage.stop()

    def num_free_slots(self) -> dict[str, int]:
        return {s.name: s.num_free_slots for s in self.stages if self.graph.node(s.name).needs_kv}

    def num_slots(self) -> dict[str, int]:
        return {s.name: s.num_slots for s in self.stages if self.graph.node(s.name).needs_kv}

    def replica_status(self) -> dict[str, list[dict]]:
        """Per stage, each replica's state and load (for /health and metrics)."""
        return replica_status(self.stages)

    def stats(self) -> EngineStats:
        """Queues, slots, batch sizes and step times, read without stopping the step loops."""
        stages = [_stage_stats(s, self.admission.num_waiting(s.name), self._first_outputs[s.name])
                  for s in self.stages]
        return EngineStats(len(self._streams), stages, self.admission.num_refused, self.replica_status(),
                           get_platform(self.cfg.platform).allocator_counters())

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

    async def _admit(self, req: OmniRequest, submitted_at: float) -> RequestOutput:
        voice = self._check_voice(req)
        tools = self._prompt_tools(req)
        prompt = await asyncio.to_thread(self.models.encoder.encode, req.messages, tools)
        messages, dropped = (self._truncated(req, prompt.message_tokens) if req.truncation is not None
                             else (req.messages, 0))
        if dropped:
            prompt = await asyncio.to_thread(self.models.encoder.encode, messages, tools)
        constraint = await self._compiled(req)
        n_prompt = len(prompt.input_ids)
        params = self._all_params(req, n_prompt)
        path = self.graph.path(req.wants_audio)
        stream = RequestOutput(req, asyncio.get_running_loop(), asyncio.Queue(), n_prompt, path,
                               self.cfg.max_output_buffer_bytes, self._overflow, async_output=self.cfg.async_output,
                               truncated_messages=dropped, submitted_at=submitted_at)
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

    async def _compiled(self, req: OmniRequest) -> Constraint | None:
        """The request's grammar, compiled in a worker thread (cached by spec), never on a stage's step path."""
        if not self._is_constrained(req):
            return None
        try:
            return await asyncio.to_thread(lambda: self.models.grammars.compile(self._constraint_spec(req)))
        except ConstraintError as exc:
            raise RequestError(str(exc), "tools" if self._forces_calls(req) else "response_format",
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

    def _overflow(self, stream: RequestOutput) -> None:
        log.warning("%s: output buffer over %d bytes (the client is not reading); aborting",
                    stream.request.request_id, stream.max_buffered_bytes)
        self.abort(stream.request.request_id, "output buffer full: the client is not reading")

    async def _events(self, stream: RequestOutput) -> AsyncIterator[Event]:
        rid, index, pending = stream.request.request_id, 0, []
        detok = IncrementalDetokenizer(self.models.tokenizer)
        text_out = TextEvents(rid, self.models.tool_parser() if self._prompt_tools(stream.request) else None)
        try:
            while True:
                kind, *data = await stream.get()
                if kind == "tokens":
                    pending.extend(data[0])
                    text = detok.add(data[0])
                    if text:  # else an incomplete UTF-8 sequence: wait for the next token
                        for ev in text_out.feed(text, pending):
                            yield ev
                        pending = []
                elif kind == "audio":
                    yield AudioChunk(rid, data[0], index)
                    index += 1
                else:  # with the text held back (an incomplete UTF-8 tail, what may start a tool call)
                    for ev in text_out.feed(detok.flush() if pending else "", pending, final=True):
                        yield ev
                    yield text_out.finished(data[0])
                    return
        finally:
            if not stream.closed:
                self.abort(rid)

    # ---- routing step results along the graph (stage threads) --------------------------------------------

    def _on_step(self, stage: str, result: StepResult) -> None:
        node, handoffs, now = self.graph.node(stage), {}, time.perf_counter()
        if stage == self.graph.names[0]:  # the first stage's prefix hits are the request's cached tokens
            for rid, n in result.cached:
                if (stream := self._streams.get(rid)) is not None:
                    stream.num_cached_tokens = n
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            item = node.to_client(out)
            if item is not None:
                stream.push(item)
            if (out.token is not None or item is not None) and stage not in stream.served_by:
                stream.served_by.add(stage)  # one thread per stage: no two threads add the same name
                self._first_outputs[stage].observe(now - stream.submitted_at)
            if out.payload is not None:
                nxt = self.graph.next_stage(stage, stream.request.wants_audio)
                if nxt is not None:
                    handoffs.setdefault(nxt, []).append((out.request_id, out.payload))
                if node.counts_audio_frames:
                    stream.num_audio_frames += 1
        for nxt, items in handoffs.items():  # one hand-off per step and next stage
            self.stage(nxt).send_inputs(items)
        for fin in result.finished:
            stream = self._streams.get(fin.request_id)
            if stream is not None and not self._failed(fin, stream):
                self._finished_in(stage, fin, stream)

    def _finished_in(self, stage: str, fin: Finish, stream: RequestOutput) -> None:
        """The request is done in `stage`: the first stage's end is the reply's; the last one closes it."""
        if stage == self.graph.names[0]:
            stream.finish_reason = FINISH_REASONS[fin.status]
            stream.num_completion_tokens = fin.num_output_tokens
        nxt = self.graph.next_stage(stage, stream.request.wants_audio)
        if nxt is not None:
            self.stage(nxt).send(StageMessage(Command.INPUT_DONE, fin.request_id))
        else:
            self._close_soon(stream)

    def _failed(self, fin: Finish, stream: RequestOutput) -> bool:
        """Aborted or errored: the request ends in every stage, with one Finished event."""
        if fin.status is RequestStatus.FINISHED_ABORTED:
            return True
        if fin.status is RequestStatus.FINISHED_ERROR:
            for stage in self.stages:
                stage.send(StageMessage(Command.ABORT, fin.request_id))
            self._close_soon(stream, "error", fin.error)
            return True
        return False

    def _close_soon(self, stream: RequestOutput, reason: str | None = None, error: str | None = None) -> None:
        """From a stage thread: close on the event loop, after the outputs already pushed. Request state
        (the stream table, admission) changes on the loop's thread only, so a finish racing an abort
        releases admission once."""
        stream.loop.call_soon_threadsafe(self._close, stream, reason, error)

    def _close(self, stream: RequestOutput, reason: str | None = None, error: str | None = None) -> None:
        """On the event loop only."""
        if stream.closed:
            return
        stream.closed = True
        self._streams.pop(stream.request.request_id, None)
        self.admission.release(stream.stages)
        usage = Usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_audio_frames,
                      stream.num_cached_tokens)
        stream.put(("finished", Finished(stream.request.request_id, reason or stream.finish_reason, usage, error,
                                         stream.truncated_messages)))


def _num_leading_system(messages: list[dict]) -> int:
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    return n


def _stage_stats(stage, admission_waiting: int, first_outputs: FirstOutputTimes) -> StageStats:
    """An in-process stage reports its scheduler and step counters; a replica pool only its slots (and, as
    every stage, when its first outputs came: the engine times those)."""
    free_slots, slots = stage.num_free_slots, stage.num_slots
    counts, sum_s = first_outputs.snapshot()
    timed = {"first_output_counts": counts, "first_output_s": sum_s}
    if not isinstance(stage, Stage):
        return StageStats(stage.name, free_slots, slots, admission_waiting, **timed)
    return StageStats(stage.name, free_slots, slots, admission_waiting, stage.scheduler.num_running,
                      stage.num_waiting, list(stage.batch_size_counts), stage.busy_s, stage.device_wait_s,
                      *stage.prefix_stats(), *stage.scheduler.waits.snapshot(), **timed,
                      decode_steps=stage.num_decode_steps, decode_busy_s=stage.decode_busy_s)
