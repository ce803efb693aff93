"""The app's open Realtime sessions, over every transport (WebSocket, WebRTC): admission against
`max_sessions`, the session counts in /metrics (`omnirt_sessions_active{transport}`,
`omnirt_sessions_total{transport,state}`), and the end of every session, with a reason, when the server
shuts down (a `Lifecycle.on_deadline` hook: after running responses finished or the drain deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.audio.vad import VadBatcher
from app.ops.metrics import Metrics
from app.realtime.events import ProtocolError
from app.realtime.session import RealtimeLimits, RealtimeSession

log = logging.getLogger(__name__)
Ender = Callable[[str], Awaitable[object]]  # end(reason): the transport closes the session, saying why
NOTICE_TIMEOUT_S = 2.0  # a client that takes no events does not hold up the shutdown


@dataclass(slots=True, frozen=True)
class _Entry:
    transport: str
    end: Ender


class SessionRegistry:
    def __init__(self, limits: RealtimeLimits, metrics: Metrics):
        self.limits, self.metrics = limits, metrics
        self.sessions: dict[RealtimeSession, _Entry] = {}
        self.vad = VadBatcher()  # every session's VAD, evaluated together
        metrics.watch_vad(self.vad)

    @property
    def is_full(self) -> bool:
        return len(self.sessions) >= self.limits.max_sessions

    def refused(self, transport: str) -> None:
        """Count a session refused at connect (engine full, draining, session limit, unknown model)."""
        self.metrics.sessions.labels(transport, "refused").inc()

    def try_add(self, session: RealtimeSession, transport: str, end: Ender) -> bool:
        if self.is_full:
            self.refused(transport)
            return False
        self.sessions[session] = _Entry(transport, end)
        self.metrics.sessions_active.labels(transport).inc()
        return True

    def remove(self, session: RealtimeSession, state: str) -> None:
        """The session ended (`state`: closed, timeout, shutdown, failed, policy, slow_client); idempotent."""
        entry = self.sessions.pop(session, None)
        if entry is not None:
            self.metrics.sessions_active.labels(entry.transport).dec()
            self.metrics.sessions.labels(entry.transport, state).inc()

    async def end_all(self, reason: str) -> None:
        """Tell every session why (an `error` event), then let its transport close it."""
        await asyncio.gather(*(self._end(s, e, reason) for s, e in list(self.sessions.items())),
                             return_exceptions=True)

    async def _end(self, session: RealtimeSession, entry: _Entry, reason: str) -> None:
        log.info("ending the session: %s", reason, extra={"session_id": session.id})
        with contextlib.suppress(TimeoutError):  # a response the drain ended says so first (response.done)
            if session.response is not None:
                await asyncio.wait_for(session.response.wait(), NOTICE_TIMEOUT_S)
            await asyncio.wait_for(session.send_error(ProtocolError(reason, "server_shutting_down",
                                                                    error_type="server_error")), NOTICE_TIMEOUT_S)
        await entry.end(reason)
