"""`GET /v1/realtime`: the OpenAI Realtime protocol over a WebSocket, on top of `app.session`.

One reader loop (client events, size limit, idle timeout) and one writer task (the session's
outbox -> text frames) per connection. A client that sends `OpenAI-Beta: realtime=v1` (or offers the
`openai-beta.realtime-v1` subprotocol, as browsers must) gets the beta event names and session shape.
Refusals at connect are an `error` event followed by a close code: 1008 for an unknown model,
1013 when `max_sessions` are open. The idle timeout sends an `error` event, then closes with 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from app.admission import session_refusal
from app.realtime_events import ProtocolError, error_event
from app.session import RealtimeLimits, RealtimeSession

log = logging.getLogger(__name__)
router = APIRouter()
CLOSE_POLICY, CLOSE_TRY_AGAIN = 1008, 1013


class SessionRegistry:
    """The app's open Realtime sessions: admission against `max_sessions`, close-all on shutdown."""

    def __init__(self, limits: RealtimeLimits):
        self.limits = limits
        self.sessions: set[RealtimeSession] = set()

    def try_add(self, session: RealtimeSession) -> bool:
        if len(self.sessions) >= self.limits.max_sessions:
            return False
        self.sessions.add(session)
        return True

    async def close_all(self) -> None:
        await asyncio.gather(*(s.close() for s in list(self.sessions)), return_exceptions=True)


def install(app: FastAPI, limits: RealtimeLimits) -> None:
    app.state.realtime = SessionRegistry(limits)
    app.router.on_shutdown.append(app.state.realtime.close_all)
    app.include_router(router)


def _is_beta(ws: WebSocket) -> bool:
    header = ws.headers.get("openai-beta", "").replace(" ", "").lower()
    offered = ws.headers.get("sec-websocket-protocol", "").replace(" ", "").lower().split(",")
    return "realtime=v1" in header.split(",") or "openai-beta.realtime-v1" in offered


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    server, registry = ws.app.state.server, ws.app.state.realtime
    offered = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
    model = ws.query_params.get("model") or server.model_names[0]
    if model not in server.model_names:
        return await _refuse(ws, ProtocolError(f"the model {model!r} does not exist; served: "
                                               f"{', '.join(server.model_names)}", "model_not_found", "model"),
                             CLOSE_POLICY)
    refusal = session_refusal(server)  # engine at capacity, or the server is draining
    if refusal is not None:
        code, reason = refusal
        return await _refuse(ws, ProtocolError(reason, "server_busy" if code == CLOSE_TRY_AGAIN else
                                               "server_shutting_down", error_type="server_error"), code)
    session = RealtimeSession(server.engine, model, registry.limits, beta=_is_beta(ws),
                              instructions=server.system_prompt or "")
    if not registry.try_add(session):
        return await _refuse(ws, ProtocolError(f"the server has {registry.limits.max_sessions} realtime sessions "
                                               "open; try again later", "session_limit_reached",
                                               error_type="server_error"), CLOSE_TRY_AGAIN)
    log.info("realtime %s: open (model %s, beta %s)", session.id, model, session.beta)
    writer = asyncio.create_task(_write(ws, session))
    try:
        await session.start()
        close_code = await _read(ws, session, registry.limits)
    finally:
        registry.sessions.discard(session)
        await session.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, timeout=5)
        writer.cancel()
        log.info("realtime %s: closed", session.id)
    if close_code is not None and ws.application_state is WebSocketState.CONNECTED:
        with contextlib.suppress(Exception):
            await ws.close(close_code)


async def _read(ws: WebSocket, session: RealtimeSession, limits: RealtimeLimits) -> int | None:
    """Client events until the client goes (None) or the session idles out (a close code)."""
    while True:
        try:
            msg = await asyncio.wait_for(ws.receive(), timeout=limits.idle_timeout_s)
        except TimeoutError:
            if session.is_busy:
                continue
            await session.send_error(ProtocolError(f"no client event for {limits.idle_timeout_s:g} s: closing the "
                                                   "session", "session_idle_timeout"))
            return 1000
        except WebSocketDisconnect:
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        data = msg.get("text") if msg.get("text") is not None else msg.get("bytes")
        if data is None:
            continue
        if len(data) > limits.max_event_bytes:
            await session.send_error(ProtocolError(f"the event is {len(data)} bytes; the limit is "
                                                   f"{limits.max_event_bytes}", "event_too_large"))
            continue
        await session.handle_text(data)


async def _write(ws: WebSocket, session: RealtimeSession) -> None:
    while (event := await session.outbox.get()) is not None:
        try:
            await ws.send_text(json.dumps(event))
        except Exception:  # the client is gone: keep draining so that producers never block
            continue


async def _refuse(ws: WebSocket, exc: ProtocolError, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(error_event(exc)))
        await ws.close(code, reason=exc.code)
