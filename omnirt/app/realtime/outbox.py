"""The bounded queue of server events between a session and its transport.

A full queue (`max_events` events, or `max_audio_bytes` of queued audio deltas: one delta may be ~100 KB)
makes the producer wait, so a slow client cannot grow server memory; a barge-in drops a
response's audio deltas that are still queued and any that arrive later. Events are stored with
GA names and renamed for a beta client on the way out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from omnirt.app.realtime.events import AUDIO_DELTA, to_beta


class Outbox:
    def __init__(self, max_events: int, beta: bool, max_audio_bytes: int = 4 * 2**20):
        self.max_events, self.beta, self.max_audio_bytes = max_events, beta, max_audio_bytes
        self._events: deque[dict[str, Any]] = deque()
        self._audio_bytes = 0  # base64 of the queued audio deltas
        self._cond = asyncio.Condition()
        self._dropped: set[str] = set()
        self._closed = False

    async def put(self, event: dict[str, Any], wanted: Callable[[], bool] | None = None) -> None:
        """Queue `event` (waiting for room); dropped if `wanted()` is false by the time its turn comes, since
        a put may wait while later events (an item's deletion) go ahead."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._has_room or self._closed)
            if self._closed or (event["type"] == AUDIO_DELTA and event.get("response_id") in self._dropped) or \
                    (wanted is not None and not wanted()):
                return
            self._events.append(event)
            self._audio_bytes += _audio_size(event)
            self._cond.notify_all()

    @property
    def _has_room(self) -> bool:
        return len(self._events) < self.max_events and self._audio_bytes < self.max_audio_bytes

    async def get(self) -> dict[str, Any] | None:
        """The next event in the client's dialect; None once closed and drained."""
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: self._events or self._closed)
                if not self._events:
                    return None
                event = self._events.popleft()
                self._audio_bytes -= _audio_size(event)
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
            self._audio_bytes = sum(map(_audio_size, self._events))
            self._cond.notify_all()
            return before - len(self._events)

    async def close(self) -> None:
        """No more events; `get` drains what is queued, then returns None."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()


def _audio_size(event: dict[str, Any]) -> int:
    return len(event["delta"]) if event["type"] == AUDIO_DELTA else 0
