"""The bounded queue of server events between a session and its transport.

A full queue makes the producer wait (a slow client cannot grow server memory); a barge-in drops a
response's audio deltas that are still queued and any that arrive later. Events are stored with
GA names and renamed for a beta client on the way out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from app.realtime.events import AUDIO_DELTA, to_beta


class Outbox:
    def __init__(self, max_events: int, beta: bool):
        self.max_events, self.beta = max_events, beta
        self._events: deque[dict[str, Any]] = deque()
        self._cond = asyncio.Condition()
        self._dropped: set[str] = set()
        self._closed = False

    async def put(self, event: dict[str, Any]) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._events) < self.max_events or self._closed)
            if self._closed or (event["type"] == AUDIO_DELTA and event.get("response_id") in self._dropped):
                return
            self._events.append(event)
            self._cond.notify_all()

    async def get(self) -> dict[str, Any] | None:
        """The next event in the client's dialect; None once closed and drained."""
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: self._events or self._closed)
                if not self._events:
                    return None
                event = self._events.popleft()
                self._cond.notify_all()
            event = to_beta(event) if self.beta else event
            if event is not None:
                return event

    async def drop_audio(self, response_id: str) -> int:
        """Forget the response's queued audio deltas, and refuse its later ones; returns how many."""
        async with self._cond:
            self._dropped.add(response_id)
            before = len(self._events)
            self._events = deque(e for e in self._events
                                 if not (e["type"] == AUDIO_DELTA and e.get("response_id") == response_id))
            self._cond.notify_all()
            return before - len(self._events)

    async def close(self) -> None:
        """No more events; `get` drains what is queued, then returns None."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()
