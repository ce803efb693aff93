"""Graceful shutdown. On SIGTERM/SIGINT the server stops accepting connections, new requests on open
connections get 503, running responses may finish until `deadline_s`; then every remaining one is
ended with the reason "server shutting down" (an error event on SSE; registered hooks close realtime
sessions with that reason, e.g. WebSocket close 1001), and only then does uvicorn's own shutdown run
(it would close WebSockets at once with 1012), closing what is left after a short grace."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn

log = logging.getLogger(__name__)
SHUTDOWN_REASON = "server shutting down"


class Lifecycle:
    def __init__(self, engine, deadline_s: float):
        self.engine, self.deadline_s = engine, deadline_s
        self.is_draining = False
        self.is_drained = False  # the deadline hooks have run
        self._hooks: list[Callable[[str], object]] = []
        self._task: asyncio.Task | None = None
        self.on_exit: Callable[[], None] = lambda: None  # ask the server to stop (set by DrainingServer)

    async def exit_when_engine_dies(self) -> None:
        """A dead engine core cannot serve anything more: the streams have ended with an error; stop the
        server (it exits non-zero)."""
        reason = await self.engine.wait_dead()
        log.error("the engine is gone (%s); the server stops", reason)
        self.begin_drain()
        self.on_exit()

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
        try:
            for hook in self._hooks:
                result = hook(SHUTDOWN_REASON)
                if asyncio.iscoroutine(result):
                    await result
        finally:
            self.is_drained = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app's Lifecycle when a shutdown signal arrives. `on_stopped` (stop the
    engine) runs inside the shutdown: uvicorn re-raises a captured SIGTERM once serving ends, which would
    kill the process before code after `run()` stops the engine core and its workers."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, on_stopped: Callable[[], None] = lambda: None):
        super().__init__(config)
        self.lifecycle, self.on_stopped = lifecycle, on_stopped
        lifecycle.on_exit = self._exit

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self.lifecycle.begin_drain)
        except RuntimeError:
            pass  # not serving yet: nothing to drain
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop listening at once, let the drain run to its end (a second signal cuts it short), then
        uvicorn's shutdown."""
        for server in self.servers:
            server.close()
        self.lifecycle.begin_drain()
        while not (self.lifecycle.is_drained or self.force_exit):
            await asyncio.sleep(0.05)
        try:
            await super().shutdown(sockets)
        finally:
            await asyncio.to_thread(self.on_stopped)
