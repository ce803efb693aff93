"""`GET /v1/realtime`: the OpenAI Realtime protocol over a WebSocket, on top of `omnirt.app.realtime.session`.

One reader loop (client events, size limit), one idle watch and one writer task (the session's
outbox -> text frames) per connection; the WebSocket itself is read by `omnirt.app.transports.ws_protocol`.
A client that sends `OpenAI-Beta: realtime=v1` (or offers the `openai-beta.realtime-v1`
subprotocol, as browsers must) gets the beta event names and session shape.
The caller's client secret (`Authorization: Bearer ek_…` or the `openai-insecure-api-key.ek_…`
subprotocol) gives the session its settings. Refusals at connect are an `error` event followed by a close
code whose reason says why: 1008 for an unknown model (or not the client secret's), 1013 when
`max_sessions` are open, the API key's own limit (`max_sessions`, `requests_per_minute`) is reached, the
engine's wait queues are full or the front end is past its load limits (`omnirt.app.ops.front_end_load`), 1001 while
the server drains. The idle timeout sends an `error` event,
then closes with 1000. A client that sends input audio faster than the session's audio rate limit gets
an `error` event (`input_audio_rate_exceeded`) and a close 1008 saying why; one that takes no event for
`send_timeout_s` is closed with 1008 "client not reading". On shutdown, once the running responses have
finished (or the drain deadline passed), each session gets an `error` event (`server_shutting_down`)
and a close 1001 "server shutting down". Log lines carry the session id and the API key's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from omnirt.app.client_secrets import starting_config
from omnirt.app.ops.admission import WS_GOING_AWAY, WS_TRY_AGAIN_LATER, session_refusal
from omnirt.app.ops.quotas import LimitExceeded
from omnirt.app.ops.secret_store import ClientSecret
from omnirt.app.realtime.config import SessionConfig
from omnirt.app.realtime.events import ProtocolError, error_event
from omnirt.app.realtime.registry import SessionRegistry, limit_error
from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession
from omnirt.app.realtime.transcription import OPENAI_MODELS as TRANSCRIPTION_MODELS
from omnirt.app.realtime.transcription_session import TRANSCRIPTION, as_transcription
from omnirt.app.state import AppState, app_state

log = logging.getLogger(__name__)
router = APIRouter()
CLOSE_POLICY, CLOSE_TRY_AGAIN, CLOSE_GOING_AWAY = 1008, WS_TRY_AGAIN_LATER, WS_GOING_AWAY
MAX_CLOSE_REASON = 123  # bytes a close frame's reason may hold (the reasons here are ASCII)
CLOSE_TIMEOUT_S = 5.0
Close = tuple[int, str, str]  # (close code, reason, how the session ended for /metrics)
TRANSPORT = "websocket"


def _is_beta(ws: WebSocket) -> bool:
    header = ws.headers.get("openai-beta", "").replace(" ", "").lower()
    offered = ws.headers.get("sec-websocket-protocol", "").replace(" ", "").lower().split(",")
    return "realtime=v1" in header.split(",") or "openai-beta.realtime-v1" in offered


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    st, principal = app_state(ws), ws.state.principal
    registry = st.sessions
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    try:  # a client secret's settings, else the server's for ?model=
        config = _starting_config(st, principal.secret, ws.query_params.get("model"), ws.query_params.get("intent"))
        if principal.key is not None:
            st.quotas.take_request(principal.key)  # a session start is a request per minute
    except ProtocolError as exc:
        return await _refuse(ws, registry, exc, CLOSE_POLICY)
    except LimitExceeded as exc:
        return await _refuse(ws, registry, limit_error(exc), CLOSE_TRY_AGAIN)
    refusal = session_refusal(st.engine, st.lifecycle, st.load)  # draining, engine or front end at capacity
    if refusal is not None:
        code, reason = refusal
        return await _refuse(ws, registry, ProtocolError(reason, "server_busy" if code == CLOSE_TRY_AGAIN else
                                                         "server_shutting_down", error_type="server_error"), code)
    error = registry.refusal(TRANSPORT, principal.key)  # the server's session limit, or the key's
    if error is not None:
        return await _refuse(ws, None, error, CLOSE_TRY_AGAIN)
    session = RealtimeSession(st.engine, config, registry.limits, registry.vad, beta=_is_beta(ws),
                              metrics=st.metrics, key_id=principal.key_id)
    conn = _Connection(ws, session)
    registry.add(session, TRANSPORT, conn.end)
    conn.log.info("realtime session open (model %s, beta %s)", config.model, session.beta)
    try:
        await conn.serve(registry.limits)
    finally:
        registry.remove(session, conn.state)
        conn.log.info("realtime session closed (%s)", conn.state)


def _starting_config(st: AppState, secret: ClientSecret | None, model: str | None, intent: str | None
                     ) -> SessionConfig:
    """`starting_config` for the connect URL; `?intent=transcription` opens a transcription session, whose
    `?model=` may also name one of OpenAI's transcription models (its transcriber; the served model runs it)."""
    if intent is None:
        return starting_config(st, secret, model)
    if intent != TRANSCRIPTION:
        raise ProtocolError(f"the intent {intent!r} is not served; the one served is {TRANSCRIPTION!r}",
                            "invalid_value", "intent")
    transcriber = model if model in TRANSCRIPTION_MODELS else None
    return as_transcription(starting_config(st, secret, None if transcriber else model), transcriber)


class _Connection:
    """One WebSocket and its session: a reader loop (client events, size limit), an idle watch, a writer task
    (the session's outbox -> text frames), and `end(reason)` for the server to close it (1001)."""

    def __init__(self, ws: WebSocket, session: RealtimeSession):
        self.ws, self.session = ws, session
        self.log = logging.LoggerAdapter(log, session.log_ids)
        self.writer: asyncio.Task | None = None
        self.state = "closed"  # how it ended, for /metrics: closed (by the client), timeout, policy, shutdown
        self.last_event_s = 0.0  # when the last client event came (the event loop's clock)

    async def serve(self, limits: RealtimeLimits) -> None:
        """Until the client goes, the session idles out or breaks a limit, or the client stops reading."""
        self.writer = asyncio.create_task(self._write(limits.send_timeout_s))
        reader, idle, close = None, None, None
        try:
            await self.session.start()
            reader = asyncio.create_task(self._read(limits))
            idle = asyncio.create_task(self._idle(limits.idle_timeout_s))
            await asyncio.wait({reader, idle, self.writer}, return_when=asyncio.FIRST_COMPLETED)
            close = next(task.result() for task in (reader, idle, self.writer) if task.done())
        finally:
            for task in (reader, idle):
                if task is not None:
                    task.cancel()
            await self._drain()
        if close is not None and self.ws.application_state is WebSocketState.CONNECTED:
            code, reason, self.state = close
            self.log.info("closing the session (%d %s)", code, reason or self.state)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):  # a client that reads nothing takes no close either
                    await self.ws.close(code, reason=reason[:MAX_CLOSE_REASON])

    async def end(self, reason: str) -> None:
        """The server ends the session: what is queued goes out, then the close (1001) says why."""
        self.state = "shutdown"
        await self._drain()
        with contextlib.suppress(Exception):
            await self.ws.close(CLOSE_GOING_AWAY, reason=reason[:MAX_CLOSE_REASON])

    async def _drain(self) -> None:
        """Close the session (its response is aborted in every stage) and let the writer send the rest."""
        await self.session.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.writer), timeout=5)
        self.writer.cancel()

    async def _read(self, limits: RealtimeLimits) -> Close | None:
        """Client events until the client goes (None) or the session breaks a limit (a close). Each event's arrival
        is noted for `_idle`: no timer per event."""
        ws, session, clock = self.ws, self.session, asyncio.get_running_loop().time
        while True:
            try:
                msg = await ws.receive()
            except (WebSocketDisconnect, RuntimeError):  # RuntimeError: `end` closed it meanwhile
                return None
            self.last_event_s = clock()
            if msg["type"] == "websocket.disconnect":
                return None
            data = msg.get("text")
            if data is None and (data := msg.get("bytes")) is None:
                continue
            if len(data) > limits.max_event_bytes:
                await session.send_error(ProtocolError(f"the event is {len(data)} bytes; the limit is "
                                                       f"{limits.max_event_bytes}", "event_too_large"))
                continue
            await session.handle_text(data)
            if session.violation is not None:
                return CLOSE_POLICY, session.violation, "policy"

    async def _idle(self, timeout_s: float) -> Close:
        """The idle timeout: `timeout_s` with no client event and no response running sends an `error` event and
        ends the session (a close 1000). A response running at the deadline starts the wait afresh."""
        clock = asyncio.get_running_loop().time
        quiet_since = self.last_event_s = clock()
        while True:
            quiet_since = max(quiet_since, self.last_event_s)
            if (left_s := quiet_since + timeout_s - clock()) > 0:
                await asyncio.sleep(left_s)
            elif self.session.is_busy:
                quiet_since = clock()
            else:
                await self.session.send_error(ProtocolError(f"no client event for {timeout_s:g} s: closing the "
                                                            "session", "session_idle_timeout"))
                return 1000, "", "timeout"

    async def _write(self, timeout_s: float) -> Close | None:
        """The outbox -> text frames, until it closes (None) or one frame waits `timeout_s` (a close)."""
        while (event := await self.session.outbox.get()) is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await self.ws.send_text(json.dumps(event))
            except TimeoutError:
                return CLOSE_POLICY, f"client not reading: an event waited {timeout_s:g} s", "slow_client"
            except Exception:  # the client is gone: keep draining so that producers never block
                continue
        return None


async def _refuse(ws: WebSocket, registry: SessionRegistry | None, exc: ProtocolError, code: int) -> None:
    """An `error` event, then the close code with the reason (counted as refused unless already counted)."""
    if registry is not None:
        registry.refused(TRANSPORT)
    log.info("realtime session refused (%d): %s", code, exc.message)
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(error_event(exc)))
        await ws.close(code, reason=exc.message[:MAX_CLOSE_REASON])
