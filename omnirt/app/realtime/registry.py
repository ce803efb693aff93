"""The app's open Realtime sessions, over every transport (WebSocket, WebRTC): admission against
`max_sessions` and each API key's own `max_sessions`, the session counts in /metrics
(`omnirt_sessions_active{transport}`, `omnirt_sessions_total{transport,state}`, `omnirt_key_active{key,kind}`),
and the end of every session, with a reason, when the server shuts down (a `Lifecycle.on_deadline` hook:
after running responses finished or the drain deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omnirt.app.audio.vad import VadBatcher
from omnirt.app.ops.keys import ApiKey
from omnirt.app.ops.metrics import Metrics
from omnirt.app.ops.quotas import LimitExceeded, refused
from omnirt.app.ops.shared import SharedLimits
from omnirt.app.realtime.events import ProtocolError
from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession

log = logging.getLogger(__name__)
Ender = Callable[[str], Awaitable[object]]  # end(reason): the transport closes the session, saying why
NOTICE_TIMEOUT_S = 2.0  # a client that takes no events does not hold up the shutdown


@dataclass(slots=True, frozen=True)
class _Entry:
    transport: str
    end: Ender
    key_id: str | None


class SessionRegistry:
    """This process's sessions; the counts the limits hold to are `shared`'s (every API worker's sessions)."""

    def __init__(self, limits: RealtimeLimits, metrics: Metrics, shared: SharedLimits | None = None,
                 worker: int = 0):
        self.limits, self.metrics = limits, metrics
        self.shared, self.worker = shared or SharedLimits(), worker
        self.sessions: dict[RealtimeSession, _Entry] = {}
        self.vad = VadBatcher()  # every session's VAD, evaluated together
        metrics.watch_vad(self.vad)

    def refusal(self, transport: str, key: ApiKey | None) -> ProtocolError | None:
        """Why a new session cannot open now (the server's session limit, or its key's, over every API worker),
        counted as refused; None: there was room, and it is taken: `add` the session right after."""
        full = self.shared.open_session(self.worker, key and key.id, self.limits.max_sessions,
                                        key and key.limits.max_sessions)
        if full == "server":
            error = ProtocolError(f"the server has {self.limits.max_sessions} realtime sessions open; try again "
                                  "later", "session_limit_reached", error_type="server_error")
        elif full == "key":
            error = limit_error(refused(self.metrics, LimitExceeded(
                key.id, "max_sessions", f"API key {key.id!r} has {key.limits.max_sessions} realtime sessions open, "
                "its limit (max_sessions); close one first.", 5.0)))
        else:
            return None
        self.refused(transport)
        return error

    def refused(self, transport: str) -> None:
        """Count a session refused at connect (engine full, draining, session limit, unknown model)."""
        self.metrics.sessions.labels(transport, "refused").inc()

    def add(self, session: RealtimeSession, transport: str, end: Ender) -> None:
        """Register a session that `refusal` let in; `end(reason)` is how the server closes it."""
        key_id = session.log_ids["key_id"]
        self.sessions[session] = _Entry(transport, end, key_id)
        self.metrics.sessions_active.labels(transport).inc()
        if key_id is not None:
            self.metrics.key_active.labels(key_id, "sessions").inc()

    def remove(self, session: RealtimeSession, state: str) -> None:
        """The session ended (`state`: closed, timeout, shutdown, failed, policy, slow_client); idempotent."""
        entry = self.sessions.pop(session, None)
        if entry is None:
            return
        self.shared.close_session(self.worker, entry.key_id)
        self.metrics.sessions_active.labels(entry.transport).dec()
        self.metrics.sessions.labels(entry.transport, state).inc()
        if entry.key_id is not None:
            self.metrics.key_active.labels(entry.key_id, "sessions").dec()

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


def limit_error(exc: LimitExceeded) -> ProtocolError:
    """A key's limit as the Realtime `error` a session is refused with."""
    return ProtocolError(exc.message, "rate_limit_exceeded", error_type="rate_limit_error")
