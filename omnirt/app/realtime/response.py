"""One Realtime response: an engine request streamed out as server events, and how it ends.

Lifecycle: `response.created` -> output item / content part added -> text or transcript deltas and
audio deltas (and, with tools, a `function_call` item per call with `response.function_call_arguments.delta`
events) -> the `.done` events -> `response.done` with status `completed`, `incomplete`
(`max_output_tokens`), `failed`, or `cancelled` (`turn_detected` / `client_cancelled`).
Cancelling aborts the request in every engine stage at once (`engine.abort`), drops its queued
audio from the outbox (or the audio sink), and ends the event stream with `response.done` (whose usage
still counts the prompt, and the tokens of it reused); no audio delta of the response is sent after that.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from omnirt.app.audio.pcm import pcm16_to_float
from omnirt.app.audio.resample import LowDelayResampler
from omnirt.app.audio.wire import PCM16, encode
from omnirt.app.ops.metrics import Metrics
from omnirt.app.realtime.config import ResponseOptions, format_object
from omnirt.app.realtime.conversation import Content, Item, item_object
from omnirt.app.realtime.events import ProtocolError, error_event, new_id
from omnirt.app.realtime.outbox import Outbox
from omnirt.app.realtime.submit import submit
from omnirt.pipeline.api import (
    AudioChunk,
    EngineClient,
    Finished,
    OmniRequest,
    TextDelta,
    ToolCallDelta,
)

log = logging.getLogger(__name__)
_STATUS = {"stop": ("completed", None), "tool_calls": ("completed", None),
           "length": ("incomplete", "max_output_tokens"), "abort": ("cancelled", "client_cancelled"),
           "error": ("failed", None)}


class AudioSink(Protocol):
    """Where a transport that plays audio itself (WebRTC) takes the output instead of audio deltas."""

    async def write(self, response_id: str, item_id: str, pcm16: bytes) -> None:
        """Queue mono PCM16 at the engine's output rate for playback (may wait: the queue is bounded)."""

    def clear(self) -> None:
        """Drop everything queued (barge-in)."""

    def played_ms(self, item_id: str) -> int:
        """How much of the item's audio has actually been played."""


class Response:
    """Its output items, in order: the message (text or audio) unless the reply is only tool calls, and a
    `function_call` item per call. Each item enters the conversation (`add_item`, which returns the id it
    follows) as it opens; without tools the message opens at once, with tools at its first text or audio."""

    def __init__(self, engine: EngineClient, outbox: Outbox, response_id: str, item: Item, opts: ResponseOptions,
                 beta: bool, add_item: Callable[[Item], str | None], audio_sink: AudioSink | None = None,
                 metrics: Metrics | None = None, log_ids: dict[str, str | None] | None = None,
                 on_truncated: Callable[[int], None] | None = None):
        self.engine, self.outbox, self.id, self.item, self.opts = engine, outbox, response_id, item, opts
        self.beta, self.add_item, self.audio_sink = beta, add_item, audio_sink
        self.metrics, self.on_truncated = metrics, on_truncated
        self.outputs: list[Item] = []  # the items opened so far, in output order
        self._previous: dict[str, str | None] = {}  # item id -> the conversation item it follows
        self._calls: dict[int, Item] = {}  # the reply's call index -> its function_call item
        self._ids = {"request_id": response_id, **(log_ids or {})}  # for log lines: + session and key ids
        self.status, self.reason, self.error = "in_progress", None, None
        self.cancel_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.task: asyncio.Task | None = None
        self._has_output = asyncio.Event()  # its first audio (text, for a text reply) went out
        self._num_samples_out = 0
        fmt = opts.output_format
        self._engine_rate = engine.info().output_sample_rate
        self._resampler = LowDelayResampler(self._engine_rate, fmt.sample_rate)
        item.content = [Content("output_audio", transcript="") if opts.wants_audio else Content("output_text", text="")]

    @property
    def is_done(self) -> bool:
        return self.status != "in_progress"

    @property
    def has_output(self) -> bool:
        return self._has_output.is_set() or self.is_done

    async def first_output(self) -> None:
        """Returns once the response sent its first audio (its first text, for a text reply) or ended: what
        a transcription of the user's turn waits for, so that it never delays the reply's first audio."""
        waiter = asyncio.ensure_future(self._has_output.wait())
        try:
            await asyncio.wait([waiter, *([self.task] if self.task is not None else [])],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def start(self, messages: list[dict]) -> None:
        self.task = asyncio.create_task(self._run(messages), name=f"response-{self.id}")

    async def cancel(self, reason: str) -> None:
        """End the response now in every stage; returns once `response.done` is queued."""
        if self.is_done or self.cancel_reason:
            return await self.wait()
        self.cancel_reason = reason
        self.engine.abort(self.id)
        await self.outbox.drop_audio(self.id)
        if self.audio_sink is not None:
            self.audio_sink.clear()
        await self.wait()

    async def wait(self) -> None:
        if self.task is not None:
            await asyncio.shield(self.task)

    def abort(self) -> None:
        """The session is gone: free the engine's slots, emit nothing more."""
        self.engine.abort(self.id)
        if self.task is not None:
            self.task.cancel()

    # ---- the response task ---------------------------------------------------------------------------

    async def _run(self, messages: list[dict]) -> None:
        await self._emit("response.created", response=self.object())
        started = time.monotonic()
        try:
            events = await submit(self.engine, self._request(messages), self.metrics, "realtime")
        except ProtocolError as exc:
            return await self._fail(exc)
        except Exception:
            log.exception("response %s: the engine refused it", self.id, extra=self._ids)
            return await self._fail(ProtocolError("the response could not start", "internal_error",
                                                  error_type="server_error"))
        if self.cancel_reason:  # cancelled while the prompt was being encoded
            self.engine.abort(self.id)
        if self.metrics is not None:
            events = self.metrics.observe(events, "realtime", started, self._ids)
        if not self._may_call:
            await self._open_message()
        try:
            await self._stream(events)
        except Exception:  # a bug here must not leave the session with a response that never ends
            log.exception("response %s: streaming failed", self.id, extra=self._ids)
            self.status, self.error = "failed", {"type": "server_error", "code": "internal_error",
                                                 "message": "streaming the response failed"}
        await self._close()

    @property
    def _may_call(self) -> bool:
        return bool(self.opts.tools) and self.opts.tool_choice != "none"

    async def _stream(self, events) -> None:
        try:
            async for ev in events:
                if isinstance(ev, Finished):  # a cancelled response's too: what its prompt took (usage, the cut)
                    self._finished(ev)
                elif self.cancel_reason:
                    continue  # what was already on its way is dropped; the engine ends the stream
                elif isinstance(ev, TextDelta):
                    await self._text(ev.text)
                elif isinstance(ev, ToolCallDelta):
                    await self._call(ev)
                elif isinstance(ev, AudioChunk):
                    await self._audio(self._resampler(pcm16_to_float(ev.pcm16)), ev.pcm16)
        finally:
            await events.aclose()
        if self.opts.wants_audio and not self.cancel_reason and self.item in self.outputs:
            await self._audio(self._resampler.flush(), b"")

    async def _fail(self, exc: ProtocolError) -> None:
        self.status, self.error = "failed", {"type": exc.error_type, "code": exc.code, "message": exc.message}
        await self.outbox.put(error_event(exc))
        await self._emit("response.done", response=self.object())

    def _request(self, messages: list[dict]) -> OmniRequest:
        sampling = {"max_tokens": self.opts.max_output_tokens, "temperature": self.opts.temperature}
        return OmniRequest(self.id, messages, ("text", "audio") if self.opts.wants_audio else ("text",),
                           voice=self.opts.voice, thinker_sampling={k: v for k, v in sampling.items() if v is not None},
                           talker_sampling=self.opts.talker_sampling or {}, truncation=self.opts.truncation,
                           cache_salt=self._ids.get("key_id"),  # one API key's sessions share cached prefixes
                           tools=list(self.opts.tools), tool_choice=self.opts.tool_choice)

    def _finished(self, fin: Finished) -> None:
        if fin.truncated_messages and self.on_truncated is not None:
            self.on_truncated(fin.truncated_messages)
        self.status, self.reason = _STATUS[fin.finish_reason]
        if fin.finish_reason == "error":
            self.error = {"type": "server_error", "code": "generation_failed", "message": fin.error or "failed"}
        elif fin.error:  # the server ended it (shutdown, unread output): not the client's cancel
            self.status, self.reason = "failed", None
            self.error = {"type": "server_error", "code": "request_aborted", "message": fin.error}
        u = fin.usage
        out = u.completion_tokens + u.audio_frames
        self.usage = {"total_tokens": u.prompt_tokens + out, "input_tokens": u.prompt_tokens, "output_tokens": out,
                      "input_token_details": {"cached_tokens": u.cached_tokens, "text_tokens": u.prompt_text_tokens,
                                              "audio_tokens": u.prompt_audio_tokens,
                                              "image_tokens": u.prompt_image_tokens},
                      "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": u.audio_frames}}

    async def _text(self, text: str) -> None:
        await self._open_message()
        part = self.item.content[0]
        if self.opts.wants_audio:
            if not part.is_truncated:  # the client cut the item: what comes after the cut was not heard
                part.transcript += text
            await self._emit("response.output_audio_transcript.delta", **self._where(), delta=text)
        else:
            part.text += text
            await self._emit("response.output_text.delta", **self._where(), delta=text)
            self._has_output.set()

    async def _audio(self, samples: np.ndarray, engine_pcm16: bytes) -> None:
        """Deltas in the output format, or the engine's PCM16 to the audio sink; `audio_ms` counts what left."""
        if engine_pcm16 or samples.size:
            await self._open_message()
        part = self.item.content[0]
        if self.audio_sink is not None:
            if engine_pcm16:
                if not part.is_truncated:
                    part.audio_ms += len(engine_pcm16) // 2 * 1000 // self._engine_rate
                await self.audio_sink.write(self.id, self.item.id, engine_pcm16)
                self._has_output.set()
            return
        if not samples.size:
            return
        fmt = self.opts.output_format
        data = engine_pcm16 if fmt is PCM16 and self._resampler.is_identity else encode(samples, fmt)
        self._num_samples_out += samples.size
        if not part.is_truncated:
            part.audio_ms = self._num_samples_out * 1000 // self.opts.output_format.sample_rate
        await self._emit("response.output_audio.delta", **self._where(), delta=base64.b64encode(data).decode())
        self._has_output.set()

    async def _call(self, ev: ToolCallDelta) -> None:
        """A piece of a tool call: the first opens its function_call item, the next ones stream its arguments."""
        if ev.name is not None:
            item = Item(new_id("item"), "assistant", type="function_call", call_id=ev.call_id, name=ev.name)
            self._calls[ev.index] = item
            await self._open(item)
            return
        item = self._calls[ev.index]
        item.arguments += ev.arguments
        await self._emit("response.function_call_arguments.delta", response_id=self.id, item_id=item.id,
                         output_index=self.outputs.index(item), call_id=item.call_id, delta=ev.arguments)

    async def _open_message(self) -> None:
        if self.item in self.outputs:
            return
        await self._open(self.item)
        await self._emit("response.content_part.added", **self._where(), part=self._part())

    async def _open(self, item: Item) -> None:
        item.status = "in_progress"
        self.outputs.append(item)
        wire = item_object(item, self.beta)
        await self._emit("response.output_item.added", response_id=self.id, output_index=len(self.outputs) - 1,
                         item=wire)
        if self.opts.in_conversation:
            self._previous[item.id] = self.add_item(item)
            await self._emit("conversation.item.added", previous_item_id=self._previous[item.id], item=wire)

    async def _close(self) -> None:
        """Every item done, in order, then `response.done`."""
        if self.cancel_reason:
            self.status, self.reason = "cancelled", self.cancel_reason
        for index, item in enumerate(self.outputs):
            is_whole = self.status == "completed" if item is self.item else self._is_whole_call(item)
            item.status = "completed" if is_whole else "incomplete"
            if item is self.item:
                await self._close_message()
            elif is_whole:  # a call cut short is not one to run: its arguments are not announced
                await self._emit("response.function_call_arguments.done", response_id=self.id, item_id=item.id,
                                 output_index=index, call_id=item.call_id, name=item.name, arguments=item.arguments)
            wire = item_object(item, self.beta)
            await self._emit("response.output_item.done", response_id=self.id, output_index=index, item=wire)
            if self.opts.in_conversation:
                await self._emit("conversation.item.done", previous_item_id=self._previous[item.id], item=wire)
        await self._emit("response.done", response=self.object())

    def _is_whole_call(self, item: Item) -> bool:
        """A call to run: neither cancelled nor failed, and its arguments a JSON object (a call cut short by
        `max_output_tokens` has only the start of one; so may an unforced call the model wrote badly)."""
        if self.status not in ("completed", "incomplete"):
            return False
        try:
            return isinstance(json.loads(item.arguments), dict)
        except ValueError:
            return False

    async def _close_message(self) -> None:
        part = self.item.content[0]
        if self.opts.wants_audio:
            await self._emit("response.output_audio.done", **self._where())
            await self._emit("response.output_audio_transcript.done", **self._where(), transcript=part.transcript)
        else:
            await self._emit("response.output_text.done", **self._where(), text=part.text)
        await self._emit("response.content_part.done", **self._where(), part=self._part())

    # ---- shapes ----------------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": self.outputs.index(self.item),
                "content_index": 0}

    def _part(self) -> dict[str, Any]:
        part = self.item.content[0]
        return ({"type": "audio", "transcript": part.transcript} if self.opts.wants_audio
                else {"type": "text", "text": part.text})

    def object(self) -> dict[str, Any]:
        details = None
        if self.status in ("cancelled", "incomplete"):
            details = {"type": self.status, "reason": self.reason}
        elif self.status == "failed":
            details = {"type": "failed", "error": self.error}
        output = [item_object(item, self.beta) for item in self.outputs]
        max_tokens = self.opts.max_output_tokens or "inf"
        common = {"object": "realtime.response", "id": self.id, "status": self.status, "status_details": details,
                  "output": output, "usage": self.usage, "metadata": self.opts.metadata,
                  "conversation_id": "conv_default" if self.opts.in_conversation else None}
        if self.beta:
            return {**common, "modalities": ["text", "audio"] if self.opts.wants_audio else ["text"],
                    "voice": self.opts.voice, "output_audio_format": self.opts.output_format.name,
                    "temperature": self.opts.temperature, "max_output_tokens": max_tokens}
        return {**common, "output_modalities": ["audio"] if self.opts.wants_audio else ["text"],
                "audio": {"output": {"format": format_object(self.opts.output_format), "voice": self.opts.voice}},
                "max_output_tokens": max_tokens}

    async def _emit(self, kind: str, **fields: Any) -> None:
        await self.outbox.put({"type": kind, "event_id": new_id("event"), **fields})
