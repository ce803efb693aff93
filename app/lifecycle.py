"""Graceful shutdown. On SIGTERM/SIGINT the server stops accepting connections (uvicorn), new requests on
open connections get 503, running responses may finish until `deadline_s`; then every remaining one is
ended with the reason "server shutting down" (an error event on SSE; registered hooks close realtime
sessions with that reason), and uvicorn closes what is left after a short grace."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

log = logging.getLogger(__name__)
SHUTDOWN_REASON = "server shutting down"


class Lifecycle:
    def __init__(self, engine, deadline_s: float):
        self.engine, self.deadline_s = engine, deadline_s
        self.is_draining = False
        self._hooks: list[Callable[[str], object]] = []
        self._task: asyncio.Task | None = None

    def on_deadline(self, hook: Callable[[str], object]) -> None:
        """`hook(reason)` runs when the drain deadline passes (e.g. close realtime sessions); may be async."""
        self._hooks.append(hook)

    def begin_drain(self) -> None:
        """Runs on the event loop; idempotent."""
        if self.is_draining:
            return
        self.is_draining = True
        log.info("draining: %d running requests may finish within %.1f s", self.engine.num_active_requests,
                 self.deadline_s)
        self._task = asyncio.get_running_loop().create_task(self._end_at_deadline())

    async def _end_at_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        while self.engine.num_active_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_active_requests:
            log.warning("drain deadline: ending %d requests", self.engine.num_active_requests)
        self.engine.abort_all(SHUTDOWN_REASON)
        for hook in self._hooks:
            result = hook(SHUTDOWN_REASON)
            if asyncio.iscoroutine(result):
                await result


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app's Lifecycle when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig, frame) -> None:
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self.lifecycle.begin_drain)
        except RuntimeError:
            pass  # not serving yet: nothing to drain
        super().handle_exit(sig, frame)
