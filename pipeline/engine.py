"""OmniEngine: submit / stream / abort over the Thinker -> Talker -> Code2Wav stage graph.

The engine is asyncio-facing; each stage steps on its own thread. Stage threads only push raw
results (token ids, PCM) into a per-request queue; detokenisation and event shaping happen on the
consumer's side, off the decode loops (async output).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import numpy as np
import torch

from pipeline.admission import Admission
from pipeline.api import (
    AudioChunk,
    EngineInfo,
    EngineStats,
    Event,
    Finished,
    OmniRequest,
    RequestError,
    StageLimit,
    StageStats,
    TextDelta,
    Usage,
)
from pipeline.config import EngineConfig
from pipeline.connector import CodecStream, Command, Message
from pipeline.detokenizer import IncrementalDetokenizer
from pipeline.models import OmniModels, TalkerState
from pipeline.output import RequestOutput
from pipeline.replicas import make_stage, replica_status
from pipeline.request import FINISH_REASONS, RequestStatus, StageRequest
from pipeline.sampling import SamplingError, SamplingParams, numerically_safe
from pipeline.scheduler import Batch, StepOutput
from pipeline.stage import Stage

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
        limits = {s.name: StageLimit(s.max_num_seqs, s.max_waiting) for s in self.cfg.stages
                  if s.name == "thinker" or self.models.talker is not None}
        return EngineInfo(self.cfg.model, tuple(self.voices), self.cfg.default_voice, self.cfg.system_prompt,
                          self.models.talker is not None, self.models.input_sample_rate,
                          self.models.output_sample_rate, limits, self.cfg.retry_after_s,
                          self.cfg.max_output_buffer_bytes, self.kind)

    def check_admission(self, wants_audio: bool = True) -> None:
        """Raise EngineOverloaded when new work would have to wait past the stages' bounds (none here)."""

    def _check_voice(self, req: OmniRequest) -> str | None:
        if not req.wants_audio:
            return None
        if self.models.talker is None:
            raise RequestError("this model has no audio output", "modalities")
        voice = (req.voice or self.cfg.default_voice).lower()
        if voice not in self.models.voices:
            raise RequestError(f"unknown voice {req.voice!r}; available: {', '.join(self.voices)}", "voice",
                               "invalid_voice")
        return voice

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
        self._streams: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self.admission = Admission({s.name: StageLimit(s.max_num_seqs, s.max_waiting) for s in cfg.stages},
                                   cfg.retry_after_s)
        self.thinker = make_stage("thinker", cfg, models, self._thinker_step)
        self.stages = [self.thinker]
        if models.talker is not None:
            self.talker = make_stage("talker", cfg, models, self._talker_step)
            self.code2wav = make_stage("code2wav", cfg, models, self._audio_step)
            self.stages += [self.talker, self.code2wav]

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.models.capture_graphs()
        for stage in self.stages:
            stage.start()

    def stop(self) -> None:
        for stage in self.stages:
            stage.stop()

    def num_free_slots(self) -> dict[str, int]:
        out = {"thinker": self.thinker.num_free_slots}
        if self.models.talker is not None:
            out["talker"] = self.talker.num_free_slots
        return out

    def num_slots(self) -> dict[str, int]:
        out = {"thinker": self.thinker.num_slots}
        if self.models.talker is not None:
            out["talker"] = self.talker.num_slots
        return out

    def replica_status(self) -> dict[str, list[dict]]:
        """Per stage, each replica's state and load (for /health and metrics)."""
        return replica_status(self.stages)

    def stats(self) -> EngineStats:
        """Queues, slots, batch sizes and step times, read without stopping the step loops."""
        free, slots = self.num_free_slots(), self.num_slots()
        stages = [_stage_stats(s, free.get(s.name, 0), slots.get(s.name, 0), self.admission.num_waiting(s.name))
                  for s in self.stages]
        return EngineStats(len(self._streams), stages, self.admission.num_refused, self.replica_status())

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    # ---- the API ---------------------------------------------------------------------------------------

    async def submit(self, req: OmniRequest) -> AsyncIterator[Event]:
        """Validate and start `req`; returns the stream of its events (ending with `Finished`).
        Raises RequestError before anything starts when the request cannot be served."""
        voice = self._check_voice(req)
        prompt = await asyncio.to_thread(self.models.encoder.encode, req.messages)
        n_prompt = len(prompt.input_ids)
        th_params = self._params("thinker", req.thinker_sampling, n_prompt)
        tk_params = self._params("talker", req.talker_sampling, n_prompt + 9) if req.wants_audio else None
        stages = self.stages_for(req.wants_audio)
        stream = RequestOutput(req, asyncio.get_running_loop(), asyncio.Queue(), n_prompt, stages,
                         self.cfg.max_output_buffer_bytes, self._overflow, async_output=self.cfg.async_output)
        if req.request_id in self._streams:
            raise RequestError(f"request id {req.request_id!r} is already running", "request_id")
        self.admission.admit(stages)  # raises EngineOverloaded when a stage's wait queue is full
        self._streams[req.request_id] = stream
        try:
            state = self.models.thinker.prepare(prompt, wants_rows=req.wants_audio)
            if req.wants_audio:
                self._start_speech(req, voice, prompt, tk_params)
            self.thinker.send(Message(Command.ADD, req.request_id, self._stage_request(
                req.request_id, th_params, state, n_prompt)))
        except BaseException:
            self.abort(req.request_id)  # never leave a half-started request holding its admission
            raise
        return self._events(stream)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Free the request in every stage; its stream ends with finish_reason "abort" (and `error`,
        the reason, when the server rather than the client ended it)."""
        stream = self._streams.get(request_id)
        for stage in self.stages:
            stage.send(Message(Command.ABORT, request_id))
        if stream is not None:
            self._close(stream, "abort", error)

    def abort_all(self, error: str) -> None:
        for rid in list(self._streams):
            self.abort(rid, error)

    def stages_for(self, wants_audio: bool) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages) if wants_audio else ("thinker",)

    def check_admission(self, wants_audio: bool = True) -> None:
        """Raise EngineOverloaded if a new request would be refused now (e.g. to refuse a session at connect)."""
        self.admission.check(self.stages_for(wants_audio))

    def _overflow(self, stream: RequestOutput) -> None:
        log.warning("%s: output buffer over %d bytes (the client is not reading); aborting",
                    stream.request.request_id, stream.max_buffered_bytes)
        self.abort(stream.request.request_id, "output buffer full: the client is not reading")

    async def _events(self, stream: RequestOutput) -> AsyncIterator[Event]:
        rid, index, pending = stream.request.request_id, 0, []
        detok = IncrementalDetokenizer(self.models.tokenizer)
        try:
            while True:
                kind, *data = await stream.get()
                if kind == "tokens":
                    pending.extend(data[0])
                    text = detok.add(data[0])
                    if text:  # else an incomplete UTF-8 sequence: wait for the next token
                        yield TextDelta(rid, text, tuple(pending))
                        pending = []
                elif kind == "audio":
                    yield AudioChunk(rid, data[0], index)
                    index += 1
                else:
                    if pending:  # tokens held back for an incomplete UTF-8 tail
                        yield TextDelta(rid, detok.flush(), tuple(pending))
                    yield data[0]
                    return
        finally:
            if not stream.closed:
                self.abort(rid)

    # ---- admission helpers ----------------------------------------------------------------------------

    @staticmethod
    def _stage_request(rid: str, params: SamplingParams, state, num_prompt: int = 0) -> StageRequest:
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        return StageRequest(rid, params, state=state, num_prompt_tokens=num_prompt, generator=gen)

    def _start_speech(self, req: OmniRequest, voice: str, prompt, params: SamplingParams) -> None:
        rid = req.request_id
        state = TalkerState(self.models.voices[voice], prompt.input_ids, prompt.audio_lengths)
        talker_req = self._stage_request(rid, params, state)
        talker_req.status = RequestStatus.WAITING_FOR_INPUT
        self.talker.send(Message(Command.ADD, rid, talker_req))
        codec = CodecStream.from_config(self.cfg.connector, req.initial_codec_chunk_frames)
        codec.wait_for_input = not self.cfg.connector.async_chunk
        self.code2wav.send(Message(Command.ADD, rid, StageRequest(rid, params, state=codec)))

    # ---- stage callbacks (run on stage threads) ----------------------------------------------------

    def _thinker_step(self, stage: Stage, batch: Batch, outputs: list[StepOutput],
                      finished: list[StageRequest]) -> None:
        eos = set(self.models.thinker.eos_ids)
        for req, out in zip(batch.requests, outputs):
            stream = self._streams.get(req.request_id)
            if stream is None:
                continue
            if out.token is not None and out.token not in eos:
                stream.push(("tokens", [out.token]))
            if out.payload is not None:
                self.talker.send(Message(Command.INPUT, req.request_id, out.payload))
        for req in finished:
            stream = self._streams.get(req.request_id)
            if stream is None or self._failed(req):
                continue
            stream.finish_reason = FINISH_REASONS[req.status]
            stream.num_completion_tokens = len(req.output_ids)
            if stream.request.wants_audio:
                self.talker.send(Message(Command.INPUT_DONE, req.request_id))
            else:
                self._close_soon(stream)

    def _talker_step(self, stage: Stage, batch: Batch, outputs: list[StepOutput],
                     finished: list[StageRequest]) -> None:
        for req, out in zip(batch.requests, outputs):
            if out.payload is not None:
                self.code2wav.send(Message(Command.INPUT, req.request_id, out.payload))
                stream = self._streams.get(req.request_id)
                if stream is not None:
                    stream.num_audio_frames += 1
        for req in finished:
            if not self._failed(req):
                self.code2wav.send(Message(Command.INPUT_DONE, req.request_id))

    def _audio_step(self, stage: Stage, batch: Batch, outputs: list[StepOutput],
                    finished: list[StageRequest]) -> None:
        for req, out in zip(batch.requests, outputs):
            stream = self._streams.get(req.request_id)
            if stream is not None and len(out.payload):
                pcm = (np.clip(out.payload, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
                stream.push(("audio", pcm))
        for req in finished:
            stream = self._streams.get(req.request_id)
            if stream is not None and not self._failed(req):
                self._close_soon(stream)

    def _failed(self, req: StageRequest) -> bool:
        """Aborted or errored: the request ends in every stage, with one Finished event."""
        if req.status is RequestStatus.FINISHED_ABORTED:
            return True
        if req.status is RequestStatus.FINISHED_ERROR:
            stream = self._streams.get(req.request_id)
            for stage in self.stages:
                stage.send(Message(Command.ABORT, req.request_id))
            if stream is not None:
                self._close_soon(stream, "error", req.error)
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
        usage = Usage(stream.num_prompt_tokens, stream.num_completion_tokens, stream.num_audio_frames)
        stream.put(("finished", Finished(stream.request.request_id, reason or stream.finish_reason, usage, error)))


def _stage_stats(stage, free_slots: int, slots: int, admission_waiting: int) -> StageStats:
    """An in-process stage reports its scheduler and step counters; a replica pool only its slots."""
    if not isinstance(stage, Stage):
        return StageStats(stage.name, free_slots, slots, admission_waiting)
    return StageStats(stage.name, free_slots, slots, admission_waiting, stage.scheduler.num_running,
                      stage.num_waiting, list(stage.batch_size_counts), stage.busy_s, stage.device_wait_s)
