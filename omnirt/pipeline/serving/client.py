"""The two engine clients behind `omnirt.pipeline.api.EngineClient`.

`InprocClient` drives the engine in this process (tests, small CPU setups). `CoreProcess` spawns the
engine core process (`omnirt/pipeline/serving/core.py`) for one or several API processes; `CoreClient` is one API
process's connection to it, over ZeroMQ: a reader thread decodes what
the core sends and hands it to the event loop in one call per message; each request's events wait in
a queue bounded in bytes (a client that stops reading gets its request aborted). A dead core is
noticed within `POLL_MS`: every stream ends with an error, and `wait_dead()` returns.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from omnirt.pipeline.serving import ipc
from omnirt.pipeline.types import (
    EngineDeadError,
    EngineHealth,
    EngineInfo,
    EngineOptions,
    EngineOverloaded,
    EngineStartError,
    EngineStats,
    Event,
    Finished,
    OmniRequest,
    RequestError,
    Usage,
)

if TYPE_CHECKING:  # type-only: the core imports torch, the API process must not
    from omnirt.pipeline.serving.core import Engine

log = logging.getLogger("omnirt.client")
POLL_MS = 100
STOP_TIMEOUT_S = 30.0


class InprocClient:
    """The engine in this process, behind the same API."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def start(cls, opts: EngineOptions) -> InprocClient:
        from omnirt.pipeline.serving.core import build_engine  # deferred: keeps torch out of the API process

        return cls(build_engine(opts))

    def info(self) -> EngineInfo:
        return self.engine.info()

    def submit(self, req: OmniRequest) -> Awaitable[AsyncIterator[Event]]:
        return self.engine.submit(req)  # called, not awaited: the request counts from here (see OmniEngine)

    def abort(self, request_id: str, error: str | None = None) -> None:
        self.engine.abort(request_id, error)

    def abort_all(self, error: str) -> None:
        self.engine.abort_all(error)

    def check_admission(self, wants_audio: bool = True) -> None:
        self.engine.check_admission(wants_audio)

    @property
    def num_active_requests(self) -> int:
        return self.engine.num_active_requests

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def health(self) -> EngineHealth:
        return EngineHealth(True)

    async def wait_dead(self) -> str:
        await asyncio.Event().wait()  # an engine in this process dies with it
        return ""

    def stop(self) -> None:
        self.engine.stop()


class _Stream:
    """One request's events on the API side, bounded in unread bytes."""

    __slots__ = ("request_id", "stages", "queue", "accepted", "num_bytes", "is_finished", "is_aborted")

    def __init__(self, request_id: str, stages: tuple[str, ...], loop: asyncio.AbstractEventLoop):
        self.request_id, self.stages = request_id, stages
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.accepted = loop.create_future()
        self.num_bytes = 0
        self.is_finished = self.is_aborted = False


@dataclass(slots=True, frozen=True)
class CoreHandle:
    """What an API process needs to use a running engine core: its pid and info, and its client's pair of
    addresses (picklable: it crosses to `--api-workers` processes)."""

    pid: int
    info: EngineInfo
    to_core: str
    from_core: str


class CoreProcess:
    """The engine core in a spawned process of its own, serving `num_clients` API processes (client k at
    `handle(k)`); this process starts and stops it, and tells it when an API process is gone."""

    def __init__(self, opts: EngineOptions, num_clients: int = 1,
                 log_setup: Callable[[str, str], None] | None = None):
        self._dir = tempfile.mkdtemp(prefix="omnirt-core-")
        self._ctx = zmq.Context()
        self._to_core, self._from_core = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        control = f"ipc://{self._dir}/control-in", f"ipc://{self._dir}/control-out"
        self._to_core.bind(control[0])
        self._from_core.bind(control[1])
        self.clients = [(f"ipc://{self._dir}/in-{k}", f"ipc://{self._dir}/out-{k}") for k in range(num_clients)]
        self._proc = mp.get_context("spawn").Process(
            target=_core_entry, args=(opts, control, self.clients, os.getpid(), log_setup), name="omnirt-core")
        self.info: EngineInfo | None = None
        self._stopping = False

    @classmethod
    def start(cls, opts: EngineOptions, num_clients: int = 1,
              log_setup: Callable[[str, str], None] | None = None) -> CoreProcess:
        core = cls(opts, num_clients, log_setup)
        try:
            core._start()
        except BaseException:
            core.stop()
            raise
        return core

    def _start(self) -> None:
        self._proc.start()
        atexit.register(self.stop)
        while self.info is None:
            if not self._from_core.poll(POLL_MS):
                if not self._proc.is_alive():
                    raise EngineStartError(f"the engine core exited with code {self._proc.exitcode} while starting")
                continue
            msg = ipc.from_core.decode(self._from_core.recv())
            if isinstance(msg, ipc.StartFailed):
                raise EngineStartError(msg.message)
            if isinstance(msg, ipc.Ready):
                self.info = msg.info
        log.info("engine core running in process %d", self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def sentinel(self) -> int:
        return self._proc.sentinel

    def handle(self, client: int) -> CoreHandle:
        return CoreHandle(self._proc.pid, self.info, *self.clients[client])

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def exit_reason(self) -> str:
        return f"the engine core process exited with code {self._proc.exitcode}"

    def client_gone(self, client: int) -> None:
        """API process `client` exited: the core aborts its requests."""
        self._send(ipc.ClientGone(client))

    def stop(self) -> None:
        """Stop the core (it stops its stages and replica workers), then close and remove the sockets."""
        if self._stopping:
            return
        self._stopping = True
        if self._proc.is_alive():
            self._send(ipc.Shutdown())
            self._proc.join(STOP_TIMEOUT_S)
            if self._proc.is_alive():
                log.warning("engine core did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
                self._proc.kill()
                self._proc.join(5)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def _send(self, msg) -> None:
        if self._proc.pid is None:
            return  # never started
        try:
            self._to_core.send(ipc.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("engine core not connected; a control message was dropped")


class CoreClient:
    """An API process's connection to the engine core: started with it (`start`: this process owns the
    core) or to a core another process started (`connect`: an `--api-workers` process)."""

    def __init__(self, handle: CoreHandle, owner: CoreProcess | None = None):
        self._handle, self._owner = handle, owner
        self._ctx = zmq.Context()
        self._to_core, self._from_core = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # requests are small and the core reads them at once: never block
        self._to_core.connect(handle.to_core)
        self._from_core.connect(handle.from_core)
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._info = handle.info
        self._stats = EngineStats()
        self._dead: str | None = None
        self._dead_event: asyncio.Event | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="omnirt-core-rx", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, opts: EngineOptions, log_setup: Callable[[str, str], None] | None = None) -> CoreClient:
        core = CoreProcess.start(opts, 1, log_setup)
        return cls(core.handle(0), owner=core)

    @classmethod
    def connect(cls, handle: CoreHandle) -> CoreClient:
        return cls(handle)

    # ---- the API -------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._handle.pid

    def info(self) -> EngineInfo:
        return self._info

    def submit(self, req: OmniRequest) -> Awaitable[AsyncIterator[Event]]:
        """Sent at the call (an abort from here on reaches the core after it); awaiting gives the events."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if req.request_id in self._streams:
            raise RequestError(f"request id {req.request_id!r} is already running", "request_id")
        self._loop = asyncio.get_running_loop()
        stream = _Stream(req.request_id, self._info.stages_for(req.wants_audio), self._loop)
        try:
            data = ipc.encoder.encode(req)
        except (OverflowError, TypeError) as exc:  # e.g. an integer msgpack cannot hold
            raise RequestError(f"the request holds a value that cannot be sent to the engine: {exc}") from exc
        self._streams[req.request_id] = stream
        self._send_bytes(data)
        return self._accepted(req, stream)

    async def _accepted(self, req: OmniRequest, stream: _Stream) -> AsyncIterator[Event]:
        try:
            await stream.accepted
        except BaseException as exc:
            self._streams.pop(req.request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self.abort(req.request_id)  # cancelled while the core was starting it
            raise
        return self._events(stream)

    def abort(self, request_id: str, error: str | None = None) -> None:
        if self._dead is None and not self._stopping:
            self._send(ipc.Abort(request_id, error))

    def abort_all(self, error: str) -> None:
        for rid in list(self._streams):
            self.abort(rid, error)

    def check_admission(self, wants_audio: bool = True) -> None:
        """Refuse now what the core would refuse: this process holds every request in flight."""
        limits = self._info.stage_limits
        for stage in self._info.stages_for(wants_audio):
            n = sum(1 for s in self._streams.values() if stage in s.stages)
            if n >= limits[stage].capacity:
                raise EngineOverloaded(stage, limits[stage].capacity, self._info.retry_after_s)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self._stats

    def health(self) -> EngineHealth:
        return EngineHealth(self._dead is None, self._dead)

    async def wait_dead(self) -> str:
        if self._dead is None:
            self._loop = self._loop or asyncio.get_running_loop()
            self._dead_event = self._dead_event or asyncio.Event()
            await self._dead_event.wait()
        return self._dead

    def stop(self) -> None:
        """Close the connection; stop the core too where this process started it."""
        if self._stopping:
            return
        self._stopping = True
        if self._owner is not None:
            self._owner.stop()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(5)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()

    # ---- the process boundary --------------------------------------------------------------------------

    def _send(self, msg) -> None:
        self._send_bytes(ipc.encoder.encode(msg))

    def _send_bytes(self, data: bytes) -> None:
        """Never blocks: with no high-water mark a send fails only when the core is gone (then dropped)."""
        with self._send_lock:
            try:
                self._to_core.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("engine core not connected; a message was dropped")

    def _read(self) -> None:
        """Reader thread: decode here, deliver on the event loop in one call per message."""
        while not self._stopping:
            if self._from_core.poll(POLL_MS):
                msg = ipc.from_core.decode(self._from_core.recv(copy=False).buffer)
                if isinstance(msg, EngineStats):
                    self._stats = msg
                elif isinstance(msg, ipc.EventBatch) and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._deliver, msg.items)
            elif (reason := self._core_gone()) is not None:
                self._on_death(reason)
                return

    def _core_gone(self) -> str | None:
        """Why the core is no longer there, or None while it is (a core of another process: its pid is gone,
        which that process, its parent, makes so at once by reaping it)."""
        if self._owner is not None:
            return None if self._owner.is_alive() else self._owner.exit_reason()
        try:
            os.kill(self._handle.pid, 0)
        except ProcessLookupError:
            return f"the engine core process ({self._handle.pid}) is gone"
        return None

    def _deliver(self, items: list) -> None:
        for item in items:
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue
            if isinstance(item, ipc.Accepted):
                stream.accepted.set_result(None)
            elif isinstance(item, ipc.Rejected):
                self._streams.pop(item.request_id, None)
                stream.accepted.set_exception(_rejection(item))
            else:
                self._put(stream, item)

    def _put(self, stream: _Stream, ev: Event) -> None:
        if isinstance(ev, Finished):
            stream.is_finished = True
            self._streams.pop(stream.request_id, None)
        elif stream.is_aborted:
            return  # aborted for not reading: keep only its end
        stream.queue.put_nowait(ev)
        stream.num_bytes += ipc.num_bytes(ev)
        if stream.num_bytes > self._info.max_output_buffer_bytes and not stream.is_finished:
            stream.is_aborted = True
            log.warning("%s: output buffer over %d bytes (the client is not reading); aborting", stream.request_id,
                        self._info.max_output_buffer_bytes)
            self.abort(stream.request_id, "output buffer full: the client is not reading")

    async def _events(self, stream: _Stream) -> AsyncIterator[Event]:
        try:
            while True:
                ev = await stream.queue.get()
                stream.num_bytes -= ipc.num_bytes(ev)
                yield ev
                if isinstance(ev, Finished):
                    return
        finally:
            if not stream.is_finished:
                self.abort(stream.request_id)

    def _on_death(self, reason: str) -> None:
        log.error("%s", reason)
        self._dead = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, reason)

    def _fail_all(self, reason: str) -> None:
        """On the event loop: every request ends with an error; wait_dead() returns."""
        for stream in list(self._streams.values()):
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineDeadError(reason))
            self._put(stream, Finished(stream.request_id, "error", Usage(), reason))
        self._streams.clear()
        if self._dead_event is not None:
            self._dead_event.set()


def _rejection(r: ipc.Rejected) -> Exception:
    if r.kind == "overloaded":
        return EngineOverloaded(r.stage, r.capacity, r.retry_after_s)
    if r.kind == "internal":
        return RuntimeError(r.message)
    return RequestError(r.message, r.param, r.code)


def _core_entry(*args) -> None:
    from omnirt.pipeline.serving.core import (
        core_main,  # deferred: the spawned core process imports torch, the API process not
    )

    core_main(*args)
