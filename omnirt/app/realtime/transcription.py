"""Transcripts of the user: with `audio.input.transcription` (GA) / `input_audio_transcription` (beta) set,
each committed user audio turn is transcribed by the Thinker, the same model that hears it, and streamed
as `conversation.item.input_audio_transcription.delta` events, then `.completed` (or `.failed`); the
transcript also enters the item's `input_audio` content (`transcript`).

A transcription is an engine request of its own (text only, greedy), kept off the reply's critical
path: it starts only once the session's response in progress, if any, has sent its first audio (its
first text, for a text reply) or ended, so it never competes with the reply's prompt or its first
steps. Transcriptions run one at a time per session, in commit order (`.completed` events come in the
order of the turns); at most `MAX_PENDING` wait, beyond that a turn's transcription fails at once. A
barge-in does not touch them; deleting the item stops its transcription; closing the session aborts the
running one in the engine and sends nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from omnirt.app.fields import rule
from omnirt.app.ops.metrics import Metrics
from omnirt.app.realtime.conversation import Item
from omnirt.app.realtime.events import ProtocolError, check_fields, new_id, require
from omnirt.app.realtime.outbox import Outbox
from omnirt.app.realtime.submit import submit
from omnirt.pipeline.api import EngineClient, Finished, OmniRequest, TextDelta

log = logging.getLogger(__name__)
# OpenAI's transcription models: a client written for OpenAI names one of them; each is served by the Thinker
OPENAI_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-mini-transcribe-2025-12-15",
                 "gpt-4o-transcribe-diarize", "gpt-transcribe", "gpt-live-transcribe", "gpt-realtime-whisper")
TRANSCRIPTION_FIELDS = rule(("model", "language", "prompt"),
                            inert={"delay": (None,), "keywords": (None, []), "languages": (None, [])})
MAX_PROMPT_CHARS = 2000
MAX_PENDING = 16  # transcriptions of one session waiting for their turn
TOKENS_PER_S, MAX_TOKENS = 8, 1024  # a transcript's token budget: 16 + 8 per second of speech (~3 words/s)
_LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})*")
INSTRUCTION = ("Transcribe the user's speech verbatim: write exactly the words spoken, in the language spoken, "
               "and nothing else (no reply, no translation, no comment).")
EVENT = "conversation.item.input_audio_transcription"


@dataclass(slots=True, frozen=True)
class TranscriptionConfig:
    model: str
    language: str | None = None  # ISO-639-1 (e.g. "en"): told to the model
    prompt: str | None = None  # context for the model (vocabulary, topic)


def parse_transcription(value: Any, where: str, session_model: str) -> TranscriptionConfig | None:
    """The client's transcription object (null: off). `model` may be the session's model or one of
    OpenAI's transcription models (all served by the Thinker); left out, it is the session's model."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"`{where}` must be an object or null", "invalid_type", where)
    check_fields(TRANSCRIPTION_FIELDS, value, where)
    model = require(value, "model", (str,), where, session_model)
    if model not in (session_model, *OPENAI_MODELS):
        raise ProtocolError(f"unknown transcription model {model!r}; use {session_model!r} (the session's model) or "
                            "one of OpenAI's transcription models, all served by it", "invalid_value", f"{where}.model")
    language = require(value, "language", (str,), where)
    if language is not None and not _LANGUAGE.fullmatch(language):
        raise ProtocolError(f"`{where}.language` must be an ISO-639-1 code such as \"en\"", "invalid_value",
                            f"{where}.language")
    prompt = require(value, "prompt", (str,), where) or None
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(f"`{where}.prompt` is at most {MAX_PROMPT_CHARS} characters", "invalid_value",
                            f"{where}.prompt")
    return TranscriptionConfig(model, language, prompt)


def transcription_object(cfg: TranscriptionConfig | None) -> dict[str, Any] | None:
    return None if cfg is None else {"model": cfg.model, "language": cfg.language, "prompt": cfg.prompt}


def transcription_messages(audio: np.ndarray, cfg: TranscriptionConfig) -> list[dict[str, Any]]:
    """The request's prompt as a plain message list: rendered by the same prompt path as a reply's."""
    ask = INSTRUCTION + (f" The speech is in the language {cfg.language!r}." if cfg.language else "")
    ask += f" Context: {cfg.prompt}" if cfg.prompt else ""
    return [{"role": "system", "content": ask}, {"role": "user", "content": [{"type": "audio", "audio": audio}]}]


class Reply(Protocol):
    """What a transcription waits for: the session's response in progress (`omnirt.app.realtime.response.Response`)."""

    @property
    def has_output(self) -> bool: ...

    async def first_output(self) -> None: ...


@dataclass(slots=True)
class _Job:
    item: Item
    config: TranscriptionConfig
    request_id: str
    is_forgotten: bool = False  # the item was deleted: nothing more is sent about it


class Transcriber:
    """A session's transcriptions. `reply` returns the session's current response (None: none yet)."""

    def __init__(self, engine: EngineClient, outbox: Outbox, reply: Callable[[], Reply | None],
                 metrics: Metrics | None = None, log_ids: dict[str, str | None] | None = None):
        self.engine, self.outbox, self.reply, self.metrics = engine, outbox, reply, metrics
        self.log_ids = log_ids or {}
        self._pending: deque[_Job] = deque()
        self._current: _Job | None = None
        self._task: asyncio.Task | None = None

    async def add(self, item: Item, cfg: TranscriptionConfig) -> None:
        """Transcribe the user audio of `item` (its first content part) when its turn comes."""
        job = _Job(item, cfg, new_id("transcription"))
        if len(self._pending) >= MAX_PENDING:
            return await self._failed(job, ProtocolError(f"{MAX_PENDING} transcriptions are already waiting",
                                                         "transcription_queue_full", error_type="server_error"))
        self._pending.append(job)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"transcriber-{item.id}")

    def forget(self, item_id: str) -> None:
        """The item was deleted: stop its transcription, send nothing more about it."""
        self._pending = deque(j for j in self._pending if j.item.id != item_id)
        if self._current is not None and self._current.item.id == item_id:
            self._current.is_forgotten = True
            self.engine.abort(self._current.request_id)

    def close(self) -> None:
        """The session is gone: free the engine's slot, drop what waits, emit nothing more."""
        self._pending.clear()
        if self._current is not None and not self._current.is_forgotten:  # (a forgotten one is aborted already)
            self.engine.abort(self._current.request_id)
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._pending:
            await self._wait_for_reply()
            if not self._pending:  # forgotten while waiting
                return
            self._current = self._pending.popleft()
            try:
                await self._transcribe(self._current)
            except Exception:  # a bug must cost one transcript, not the session's later ones
                log.exception("transcription %s failed", self._current.request_id, extra=self.log_ids)
                await self._failed(self._current, ProtocolError("the transcription failed", "internal_error",
                                                                error_type="server_error"))
            finally:
                self._current = None

    async def _wait_for_reply(self) -> None:
        """Until no response of the session is still working towards its first audio."""
        while (response := self.reply()) is not None and not response.has_output:
            await response.first_output()

    async def _transcribe(self, job: _Job) -> None:
        audio = job.item.content[0].audio
        req = OmniRequest(job.request_id, transcription_messages(audio, job.config), ("text",),
                          thinker_sampling={"temperature": 0.0, "max_tokens": _max_tokens(audio, self.engine)},
                          cache_salt=self.log_ids.get("key_id"),  # the instruction's KV is shared like a reply's
                          background=True)  # replies owed their first audio go first
        started = time.monotonic()
        try:
            events = await submit(self.engine, req, self.metrics, "realtime_transcription")
        except ProtocolError as exc:
            return await self._failed(job, exc)
        if self.metrics is not None:
            events = self.metrics.observe(events, "realtime_transcription", started,
                                          {"request_id": job.request_id, **self.log_ids})
        text, fin = "", None
        try:
            async for ev in events:
                if isinstance(ev, TextDelta) and not job.is_forgotten:
                    text += ev.text
                    await self._emit("delta", job, delta=ev.text)
                elif isinstance(ev, Finished):
                    fin = ev
        finally:
            await events.aclose()
        await self._finish(job, text, fin)

    async def _finish(self, job: _Job, text: str, fin: Finished | None) -> None:
        if job.is_forgotten:
            return
        if fin is None or fin.finish_reason in ("error", "abort") or fin.error:
            reason = (fin.error if fin is not None else None) or "the transcription ended early"
            return await self._failed(job, ProtocolError(reason, "transcription_failed", error_type="server_error"))
        job.item.content[0].transcript = text
        u = fin.usage
        await self._emit("completed", job, transcript=text, usage={
            "type": "tokens", "input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens})

    async def _failed(self, job: _Job, exc: ProtocolError) -> None:
        await self._emit("failed", job, error={"type": exc.error_type, "code": exc.code, "message": exc.message,
                                               "param": exc.param})

    async def _emit(self, kind: str, job: _Job, **fields: Any) -> None:
        """Nothing about a deleted item follows its `conversation.item.deleted`, even an event already on its way."""
        await self.outbox.put({"type": f"{EVENT}.{kind}", "event_id": new_id("event"), "item_id": job.item.id,
                               "content_index": 0, **fields}, wanted=lambda: not job.is_forgotten)


def _max_tokens(audio: np.ndarray, engine: EngineClient) -> int:
    seconds = len(audio) / engine.info().input_sample_rate
    return min(MAX_TOKENS, 16 + math.ceil(TOKENS_PER_S * seconds))
