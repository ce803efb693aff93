"""A Realtime session, independent of its transport: settings, conversation, input audio with
server VAD, and at most one response at a time, driven by OpenAI Realtime client events.

The transport interface (WebSocket and WebRTC):

    session = RealtimeSession(engine, config, limits, vad, beta=False, audio_sink=None, metrics=None,
                              key_id=None)  # config: `initial_config(...)` or a client secret's;
                                            # vad: the process's VadBatcher, shared by every session
    await session.start()                     # queues `session.created`
    await session.handle_text(raw)            # a client event as JSON text: any error becomes an `error` event
    await session.handle_event(event_dict)    # the same, already parsed
    await session.append_audio(samples, rate) # float32 mono input at any rate (e.g. 48 kHz from an RTP track)
    event = await session.outbox.get()        # the next server event (dict), None once closed: send it
    await session.close()                     # aborts the running response (and transcription) in the engine

Output audio goes out as `response.output_audio.delta` events (base64 in the session's output
format), or, when the transport passes an `audio_sink` (see `omnirt.app.realtime.response.AudioSink`), as
PCM16 at the engine's output rate to that sink: WebRTC plays it on its media track, reports
`played_ms(item_id)`, and on barge-in the session clears the sink and truncates the assistant item at
the played position itself (and emits `output_audio_buffer.cleared`), as OpenAI does for WebRTC. Every queue is bounded:
the outbox (producers wait), the input buffer (`input_audio_buffer_full` error), the sink (its own).
With `metrics`, each response is counted like a chat request (endpoint "realtime") and logs a
"request finished" line with its response id, the session id and the API key's id. With transcription
set, committed user audio is transcribed beside the responses (`omnirt.app.realtime.transcription`). A
transcription session (`type: "transcription"`, `omnirt.app.realtime.transcription_session`) only transcribes:
`response.create` is refused and its turn detection creates no response.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnirt.app.audio.resample import resample
from omnirt.app.audio.vad import VAD_RATE, VadBatcher
from omnirt.app.images import ImageLimits
from omnirt.app.ops.limits import TokenBucket
from omnirt.app.ops.metrics import Metrics
from omnirt.app.realtime.config import ResponseOptions, SessionConfig, response_options
from omnirt.app.realtime.conversation import Content, Conversation, Item, decode_audio_b64, item_object, parse_item
from omnirt.app.realtime.events import ProtocolError, error_event, new_id, parse_client_event, validate_client_event
from omnirt.app.realtime.input_buffer import BufferFull, InputBuffer, TurnEnded, TurnStarted
from omnirt.app.realtime.outbox import Outbox
from omnirt.app.realtime.response import AudioSink, Response
from omnirt.app.realtime.speculation import Speculation
from omnirt.app.realtime.transcription import Transcriber
from omnirt.app.realtime.transcription_session import TRANSCRIPTION, apply_update, session_event
from omnirt.pipeline.api import EngineClient, OmniRequest

log = logging.getLogger(__name__)
MIN_COMMIT_MS = 100


@dataclass(slots=True, frozen=True)
class RealtimeLimits:
    max_sessions: int = 32
    max_event_bytes: int = 20 * 2**20  # one append may carry 15 MiB of audio = 20 MiB of base64
    max_input_buffer_s: float = 120.0
    idle_timeout_s: float = 300.0  # no client event and no response running
    max_queued_events: int = 512
    max_queued_audio_bytes: int = 4 * 2**20  # audio deltas (base64) queued for the client: ~65 s of PCM16
    max_audio_rate: float = 4.0  # input audio may come this many times faster than real time, sustained,
    audio_burst_s: float = 30.0  # after a burst of this many seconds of audio ahead of real time
    send_timeout_s: float = 30.0  # one server event the client does not take within this ends the session
    images: ImageLimits = field(default_factory=ImageLimits)  # the server's (`ServerSettings.images`)

    def __post_init__(self):
        assert self.max_sessions >= 1 and self.max_event_bytes >= 1024 and self.max_input_buffer_s > 0
        assert self.idle_timeout_s > 0 and self.max_queued_events >= 16 and self.max_queued_audio_bytes >= 2**16
        assert self.max_audio_rate >= 1 and self.audio_burst_s > 0 and self.send_timeout_s > 0


class RealtimeSession:
    def __init__(self, engine: EngineClient, config: SessionConfig, limits: RealtimeLimits, vad: VadBatcher, *,
                 beta: bool = False, audio_sink: AudioSink | None = None, metrics: Metrics | None = None,
                 key_id: str | None = None):
        self.id = new_id("sess")
        self.log_ids = {"session_id": self.id, "key_id": key_id}  # for log lines (key_id: the API key's id)
        self.vad = vad
        self.engine, self.limits, self.beta, self.audio_sink = engine, limits, beta, audio_sink
        self.metrics = metrics
        self.config = config
        self.conversation = Conversation()
        self.outbox = Outbox(limits.max_queued_events, beta, limits.max_queued_audio_bytes)
        self.input: InputBuffer | None = None
        self.response: Response | None = None
        self.transcriber = Transcriber(engine, self.outbox, lambda: self.response, metrics, self.log_ids)
        self.speculation = Speculation(engine, self.log_ids)
        self.audio_rate = TokenBucket(limits.max_audio_rate, limits.audio_burst_s)
        self.violation: str | None = None  # why the transport must close the session (policy), once set
        self._has_spoken = False  # the voice is fixed once audio was produced
        self._turn_item_id: str | None = None
        self._lock = asyncio.Lock()  # client events and input audio apply one at a time, in arrival order
        self._handlers = {
            "session.update": self._session_update, "transcription_session.update": self._transcription_update,
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit, "input_audio_buffer.clear": self._clear,
            "conversation.item.create": self._item_create, "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete, "conversation.item.retrieve": self._item_retrieve,
            "response.create": self._response_create, "response.cancel": self._response_cancel,
            "output_audio_buffer.clear": self._output_audio_clear,
        }

    @property
    def is_busy(self) -> bool:
        return self.response is not None and not self.response.is_done

    # ---- the transport-facing API ---------------------------------------------------------------------

    async def start(self) -> None:
        self.input = InputBuffer(self.limits.max_input_buffer_s, self.config.turn_detection, self.vad)
        self.input.set_noise_reduction(self.config.noise_reduction)
        await self._emit_session("created")

    async def handle_text(self, raw: str | bytes) -> None:
        try:
            event = parse_client_event(raw)
        except ProtocolError as exc:
            return await self.send_error(exc)
        await self.handle_event(event)

    async def handle_event(self, event: dict[str, Any]) -> None:
        try:
            validate_client_event(event)
            async with self._lock:
                await self._handlers[event["type"]](event)
        except ProtocolError as exc:
            client_id = event.get("event_id")
            await self.send_error(exc, client_id if isinstance(client_id, str) else None)
        except Exception:  # a bug must cost one event, not the session
            log.exception("realtime %s: %s failed", self.id, event.get("type"), extra=self.log_ids)
            await self.send_error(ProtocolError("the server failed to apply the event", "internal_error",
                                                error_type="server_error"))

    async def append_audio(self, samples: np.ndarray, sample_rate: int) -> None:
        try:
            async with self._lock:
                await self._feed(samples, sample_rate)
        except ProtocolError as exc:
            await self.send_error(exc)

    async def send_error(self, exc: ProtocolError, client_event_id: str | None = None) -> None:
        await self.outbox.put(error_event(exc, client_event_id))

    async def close(self) -> None:
        if self.response is not None and not self.response.is_done:
            self.response.abort()
        self.speculation.end_turn()
        self.transcriber.close()
        await self.outbox.close()

    # ---- session and input audio ----------------------------------------------------------------------

    async def _session_update(self, ev: dict) -> None:
        info = self.engine.info()
        new = apply_update(self.config, ev["session"], info.voice_names, info.model_aliases)
        if new.type != self.config.type and self.is_busy:
            raise ProtocolError(f"a response is in progress ({self.response.id}); cancel it or wait for response.done "
                                "before the session becomes a transcription session",
                                "conversation_already_has_active_response", "session.type")
        if new.voice != self.config.voice and self._has_spoken:
            raise ProtocolError("the voice cannot change once the model has produced audio", "invalid_value",
                                "session.voice")
        if new.turn_detection != self.config.turn_detection:
            self.input.set_vad(new.turn_detection)
            self._turn_item_id = self._turn_item_id if self.input.is_speaking else None
            if not self.input.is_speaking:
                self.speculation.end_turn()
        if new.noise_reduction != self.config.noise_reduction:
            self.input.set_noise_reduction(new.noise_reduction)
        self.config = new
        await self._emit_session("updated")

    async def _transcription_update(self, ev: dict) -> None:
        """The beta `transcription_session.update`: a session.update that makes (or keeps) it a transcription one."""
        await self._session_update({"session": {**ev["session"], "type": TRANSCRIPTION}})

    async def _append(self, ev: dict) -> None:
        fmt = self.config.input_format
        samples = decode_audio_b64(ev["audio"], fmt, "audio")
        if not self.audio_rate.take(len(samples) / fmt.sample_rate):
            lim = self.limits
            self.violation = (f"input audio arrives faster than {lim.max_audio_rate:g}x real time (after a "
                              f"{lim.audio_burst_s:g} s burst)")
            raise ProtocolError(f"{self.violation}; closing the session", "input_audio_rate_exceeded", "audio")
        await self._feed(samples, fmt.sample_rate)

    async def _feed(self, samples: np.ndarray, sample_rate: int) -> None:
        try:  # the VAD runs batched with every other session's, off the event loop
            events = await self.input.append(samples, sample_rate)
        except BufferFull as exc:
            raise ProtocolError(f"{exc}; commit or clear it", "input_audio_buffer_full", "audio") from exc
        for turn in events:
            if isinstance(turn, TurnStarted):
                await self._speech_started(turn)
            elif isinstance(turn, TurnEnded):
                await self._speech_stopped(turn)
        if self.input.is_speaking:
            self._speculate()

    def _speculate(self) -> None:
        """While the user speaks, prefill what the turn's response will start from (`speculation.py`)."""
        if self.config.prefill_while_speaking and self.config.type != TRANSCRIPTION:
            self.speculation.heard(self.input.num_heard, VAD_RATE, self._speculative_request)

    def _speculative_request(self, request_id: str) -> OmniRequest:
        """The prompt the turn's response would have if the turn ended now (as `_add_user_audio` and `Response`
        build it), as a prefill-only request."""
        info = self.engine.info()
        opts = response_options(self.config, None, info.voice_names)
        user = {"role": "user", "content": [{"type": "audio",
                                             "audio": resample(self.input.heard(), VAD_RATE, info.input_sample_rate)}]}
        return OmniRequest(request_id, [*self.conversation.preview(opts.instructions), user],
                           cache_salt=self.log_ids["key_id"], tools=list(opts.tools), tool_choice=opts.tool_choice,
                           prefill_only=True)

    async def _speech_started(self, turn: TurnStarted) -> None:
        self.speculation.end_turn()
        self._turn_item_id = new_id("item")
        await self._emit("input_audio_buffer.speech_started", audio_start_ms=turn.audio_start_ms,
                         item_id=self._turn_item_id)
        if self.config.turn_detection and self.config.turn_detection.interrupt_response:
            await self._interrupt()

    async def _speech_stopped(self, turn: TurnEnded) -> None:
        self.speculation.end_turn()  # what it prefilled stays resident for the response
        item_id, self._turn_item_id = self._turn_item_id or new_id("item"), None
        await self._emit("input_audio_buffer.speech_stopped", audio_end_ms=turn.audio_end_ms, item_id=item_id)
        await self._add_user_audio(turn.audio, item_id)
        td = self.config.turn_detection
        if td is not None and td.create_response and not self.is_busy:
            await self._start_response(response_options(self.config, None, self.engine.info().voice_names))

    async def _commit(self, ev: dict) -> None:
        if self.input.duration_ms < MIN_COMMIT_MS:
            raise ProtocolError(f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio, have "
                                f"{self.input.duration_ms} ms", "input_audio_buffer_commit_empty")
        item_id, self._turn_item_id = self._turn_item_id or new_id("item"), None
        self.speculation.end_turn()
        await self._add_user_audio(self.input.commit(), item_id)

    async def _clear(self, ev: dict) -> None:
        self.speculation.end_turn()  # a false start: what it prefilled is left to eviction
        self.input.clear()
        self._turn_item_id = None
        await self._emit("input_audio_buffer.cleared")

    async def _add_user_audio(self, audio: np.ndarray, item_id: str) -> None:
        audio = resample(audio, VAD_RATE, self.engine.info().input_sample_rate)
        item = Item(item_id, "user", [Content("input_audio", audio=audio)])
        previous = self.conversation.add(item)
        await self._emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        await self._item_added(item, previous)
        if self.config.transcription is not None:  # starts once a reply created now has sent its first audio
            await self.transcriber.add(item, self.config.transcription)

    # ---- conversation ---------------------------------------------------------------------------------

    async def _item_create(self, ev: dict) -> None:
        """Images and audio decode in a worker thread, not on the event loop."""
        item = await asyncio.to_thread(parse_item, ev["item"], self.config.input_format,
                                       self.engine.info().input_sample_rate, self.limits.images)
        self.conversation.check_images(item, self.limits.images.max_images)
        await self._item_added(item, self.conversation.add(item, ev.get("previous_item_id")))

    async def _item_added(self, item: Item, previous: str | None) -> None:
        wire = item_object(item, self.beta)
        await self._emit("conversation.item.added", previous_item_id=previous, item=wire)
        await self._emit("conversation.item.done", previous_item_id=previous, item=wire)

    async def _item_truncate(self, ev: dict) -> None:
        """Cuts the item only: a response still making it runs on until `response.cancel` (OpenAI's order for
        an interrupt is truncate, then cancel)."""
        end_ms = self.conversation.truncate(ev["item_id"], ev["content_index"], ev["audio_end_ms"])
        await self._emit("conversation.item.truncated", item_id=ev["item_id"], content_index=ev["content_index"],
                         audio_end_ms=end_ms)

    async def _item_delete(self, ev: dict) -> None:
        if self.is_busy and self.response.item.id == ev["item_id"]:
            raise ProtocolError("the item is being generated; cancel the response first", "invalid_value", "item_id")
        self.conversation.delete(ev["item_id"])
        self.transcriber.forget(ev["item_id"])
        await self._emit("conversation.item.deleted", item_id=ev["item_id"])

    async def _item_retrieve(self, ev: dict) -> None:
        await self._emit("conversation.item.retrieved", item=item_object(self.conversation.get(ev["item_id"]),
                                                                          self.beta))

    # ---- responses ------------------------------------------------------------------------------------

    async def _response_create(self, ev: dict) -> None:
        if self.config.type == TRANSCRIPTION:
            raise ProtocolError("a transcription session generates no responses: it transcribes the input audio",
                                "unsupported_event", "type")
        if self.is_busy:
            raise ProtocolError(f"a response is in progress ({self.response.id}); cancel it or wait for "
                                "response.done", "conversation_already_has_active_response")
        await self._start_response(response_options(self.config, ev.get("response"), self.engine.info().voice_names))

    async def _start_response(self, opts: ResponseOptions) -> None:
        messages = self.conversation.history(opts.instructions)
        item = Item(new_id("item"), "assistant")
        self.response = Response(self.engine, self.outbox, new_id("resp"), item, opts, self.beta, self.conversation.add,
                                 self.audio_sink, self.metrics, self.log_ids, self.conversation.leave_out)
        self._has_spoken |= opts.wants_audio
        self.response.start(messages)

    async def _response_cancel(self, ev: dict) -> None:
        if not self.is_busy:
            raise ProtocolError("there is no response in progress to cancel", "response_cancel_not_active")
        if ev.get("response_id") not in (None, self.response.id):
            raise ProtocolError(f"response {ev['response_id']!r} is not in progress", "invalid_value", "response_id")
        await self.response.cancel("client_cancelled")

    async def _interrupt(self) -> None:
        """Barge-in: cancel the running response; with an audio sink, stop playback and truncate."""
        response = self.response
        if response is None:
            return
        if not response.is_done and response.opts.in_conversation:
            await response.cancel("turn_detected")
        if self.audio_sink is not None:
            await self._flush_playback(response)

    async def _output_audio_clear(self, ev: dict) -> None:
        if self.audio_sink is None:
            raise ProtocolError("output_audio_buffer.clear is for WebRTC sessions; over WebSocket stop playback "
                                "and send conversation.item.truncate", "unsupported_event", "type")
        if self.response is not None:
            await self._flush_playback(self.response)

    async def _flush_playback(self, response: Response) -> None:
        part = response.item.content[0] if response.item.content else None
        played = self.audio_sink.played_ms(response.item.id)
        self.audio_sink.clear()
        if part is None or part.type != "output_audio" or played >= part.audio_ms:
            return
        if any(i.id == response.item.id for i in self.conversation.items):
            self.conversation.truncate(response.item.id, 0, played)
            await self._emit("conversation.item.truncated", item_id=response.item.id, content_index=0,
                             audio_end_ms=played)
        await self._emit("output_audio_buffer.cleared", response_id=response.id)

    async def _emit_session(self, kind: str) -> None:
        """`session.created` / `.updated` (`transcription_session.*` for a beta transcription session)."""
        event_type, session = session_event(self.config, self.id, self.beta, kind)
        await self._emit(event_type, session=session)

    async def _emit(self, kind: str, **fields: Any) -> None:
        await self.outbox.put({"type": kind, "event_id": new_id("event"), **fields})
