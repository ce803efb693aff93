"""The engine core: build the engine from `EngineOptions`, and serve it in a process of its own.

The core process owns the stages, their step loops and every tensor; the API process only moves
bytes. Each API process (one, or one per `--api-workers`) has two ZeroMQ sockets to the core
(`omnirt/pipeline/serving/ipc.py`): requests and aborts in, and out one `EventBatch` message per burst of its
events plus an `EngineStats` snapshot every `STATS_S`. A control pair with the process that started
the core says when to stop and when an API process is gone (its requests are aborted). The core stops
when told to, on SIGTERM, or when the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from omnirt.pipeline.config import EngineConfig, ProfileError
from omnirt.pipeline.engine.omni import OmniEngine
from omnirt.pipeline.engine.reference import ReferenceEngine
from omnirt.pipeline.models import load_models, model_spec
from omnirt.pipeline.platform import detect_platform, get_platform, set_num_threads
from omnirt.pipeline.profile import engine_config, profile_path
from omnirt.pipeline.replicas.ray_actors import RayUnavailableError, require_ray
from omnirt.pipeline.replicas.worker import watch_parent
from omnirt.pipeline.serving import ipc
from omnirt.pipeline.stage.graph import LoadedModels
from omnirt.pipeline.types import (
    EngineInfo,
    EngineOptions,
    EngineOverloaded,
    EngineStartError,
    EngineStats,
    Event,
    ModelNotFoundError,
    OmniRequest,
    RequestError,
)

log = logging.getLogger("omnirt.core")
STATS_S = 0.2  # stats snapshot (and heartbeat) period
MAX_PENDING_BYTES = 16 * 2**20  # events queued for one send: request tasks wait beyond this


class Engine(Protocol):
    """What the core (and the in-process client) serves: `OmniEngine`, or `ReferenceEngine` (`engine: reference`)."""

    @property
    def num_active_requests(self) -> int: ...

    def info(self) -> EngineInfo: ...

    def submit(self, req: OmniRequest) -> Awaitable[AsyncIterator[Event]]: ...

    def abort(self, request_id: str, error: str | None = None) -> None: ...

    def abort_all(self, error: str) -> None: ...

    def check_admission(self, wants_audio: bool = True) -> None: ...

    def stats(self) -> EngineStats: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def build_engine(opts: EngineOptions) -> Engine:
    """Profile -> platform merge -> models -> started engine. Raises EngineStartError."""
    if opts.threads:
        set_num_threads(opts.threads)
    try:
        platform = get_platform(opts.platform) if opts.platform else detect_platform()
        spec = model_spec(opts.model)
        cfg = engine_config(opts, platform.name, spec)
        if cfg.distributed == "ray":
            require_ray()  # fail before loading weights when the extra is missing
        _log_plan(platform.name, profile_path(opts, spec), cfg)
        local = tuple(s.name for s in cfg.stages if cfg.engine == "reference" or not s.needs_workers)
        models = load_models(cfg, platform, local)  # stages in replica workers load there
        cfg.check_voices(sorted(models.voices))
    except (ProfileError, ModelNotFoundError, RayUnavailableError, ValueError) as exc:
        raise EngineStartError(str(exc)) from exc
    return _start(cfg, models)


def _log_plan(platform: str, profile: Path, cfg: EngineConfig) -> None:
    log.info("platform %s, profile %s, model %s (%s, %s, engine %s)", platform, profile, cfg.model, cfg.load_format,
             cfg.dtype, cfg.engine)
    for s in cfg.stages:
        context = f" max_model_len={s.max_model_len}" if s.spec.autoregressive else ""
        log.info("stage %d %-8s max_num_seqs=%d%s eager=%s devices=%s", s.stage_id, s.name, s.max_num_seqs, context,
                 s.enforce_eager, s.devices)


def _start(cfg: EngineConfig, models: LoadedModels) -> Engine:
    engine = (ReferenceEngine if cfg.engine == "reference" else OmniEngine)(cfg, models)
    try:
        engine.start()
    except RuntimeError as exc:  # a replica that did not come up
        engine.stop()
        raise EngineStartError(str(exc)) from exc
    return engine


class _Client:
    """One API process as the core sees it: its two sockets, the events queued for it, its requests."""

    __slots__ = ("inbox", "outbox", "pending", "pending_bytes", "wake", "drained", "request_ids")

    def __init__(self, inbox: zmq.asyncio.Socket, outbox: zmq.asyncio.Socket):
        self.inbox, self.outbox = inbox, outbox
        self.pending: list = []
        self.pending_bytes = 0
        self.wake, self.drained = asyncio.Event(), asyncio.Event()
        self.request_ids: set[str] = set()


class EngineCore:
    """The core's event loop: requests in from each API process, their events back to it, batched per burst;
    the control socket says when to stop and when an API process is gone (its requests are aborted)."""

    def __init__(self, engine: Engine, control: zmq.asyncio.Socket,
                 clients: list[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]]):
        self.engine, self.control = engine, control
        self.clients = [_Client(inbox, outbox) for inbox, outbox in clients]
        self._tasks: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        """Until told to stop; a loop that fails ends the core (the API processes see it die, never a hang)."""
        loops = [asyncio.create_task(self._control_loop())]
        for client in self.clients:
            loops += [asyncio.create_task(self._send_loop(client)), asyncio.create_task(self._recv_loop(client))]
        stop = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
        for task in (*loops, stop):
            task.cancel()
        for task in done & set(loops):
            task.result()  # raises what ended it

    async def _control_loop(self) -> None:
        while True:
            msg = ipc.to_core.decode(await self.control.recv())
            if isinstance(msg, ipc.ClientGone):
                self._client_gone(self.clients[msg.client])
            elif isinstance(msg, ipc.Shutdown):
                self.stopping.set()

    def _client_gone(self, client: _Client) -> None:
        """Its requests end in every stage; what was queued for it is dropped."""
        if client.request_ids:
            log.warning("an API process is gone; aborting its %d requests", len(client.request_ids))
        for rid in list(client.request_ids):
            self.engine.abort(rid, "the API process serving it is gone")
        client.pending, client.pending_bytes = [], 0
        client.drained.set()
        client.drained.clear()

    async def _recv_loop(self, client: _Client) -> None:
        while True:
            msg = ipc.to_core.decode(await client.inbox.recv())
            if isinstance(msg, OmniRequest):
                client.request_ids.add(msg.request_id)
                task = asyncio.create_task(self._serve(client, msg.request_id, self._submit(msg)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(msg, ipc.Abort):
                self.engine.abort(msg.request_id, msg.error)
            else:
                self.stopping.set()

    def _submit(self, req: OmniRequest):
        """The engine's submit, called now (an abort read next, with no await in between, must find the
        request); what it raised comes out when awaited."""
        try:
            return self.engine.submit(req)
        except Exception as exc:
            return _raise(exc)

    async def _serve(self, client: _Client, rid: str, submitted) -> None:
        try:
            await self._stream(client, rid, submitted)
        finally:
            client.request_ids.discard(rid)

    async def _stream(self, client: _Client, rid: str, submitted) -> None:
        try:
            events = await submitted
        except RequestError as exc:
            return self._emit(client, ipc.Rejected(rid, "invalid", str(exc), exc.param, exc.code))
        except EngineOverloaded as exc:
            return self._emit(client, ipc.Rejected(rid, "overloaded", str(exc), stage=exc.stage,
                                                   capacity=exc.capacity, retry_after_s=exc.retry_after_s))
        except Exception as exc:
            log.exception("request %s: submit failed", rid)
            return self._emit(client, ipc.Rejected(rid, "internal", f"the request could not start "
                                                   f"({type(exc).__name__})", code="internal_error"))
        self._emit(client, ipc.Accepted(rid))
        async for ev in events:
            self._emit(client, ev)
            if client.pending_bytes > MAX_PENDING_BYTES:  # the API process is not reading: hold this request
                await client.drained.wait()

    @staticmethod
    def _emit(client: _Client, item) -> None:
        client.pending.append(item)
        client.pending_bytes += ipc.num_bytes(item)
        client.wake.set()

    async def _send_loop(self, client: _Client) -> None:
        loop = asyncio.get_running_loop()
        next_stats = loop.time()
        while True:
            try:
                await asyncio.wait_for(client.wake.wait(), max(0.0, next_stats - loop.time()))
            except TimeoutError:
                pass
            client.wake.clear()
            if client.pending:
                items, client.pending, client.pending_bytes = client.pending, [], 0
                client.drained.set()
                client.drained.clear()
                await client.outbox.send(ipc.encoder.encode(ipc.EventBatch(items)), copy=False)
            if loop.time() >= next_stats:
                next_stats = loop.time() + STATS_S
                with contextlib.suppress(zmq.Again):  # nobody connected (an API process being replaced)
                    await client.outbox.send(ipc.encoder.encode(self.engine.stats()), zmq.NOBLOCK)


async def _raise(exc: Exception):
    raise exc


def core_main(opts: EngineOptions, control: tuple[str, str], clients: list[tuple[str, str]], parent_pid: int,
              log_setup: Callable[[str, str], None] | None = None) -> None:
    """Entry point of the spawned engine core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process leads the stop
    if log_setup is not None:
        log_setup(opts.log_level, opts.log_format)
    asyncio.run(_serve_core(opts, control, clients, parent_pid))


async def _serve_core(opts: EngineOptions, control: tuple[str, str], clients: list[tuple[str, str]],
                      parent_pid: int) -> None:
    """`control`: the starting process's pair (it binds them: Ready or StartFailed out, Shutdown and ClientGone
    in); `clients`: one pair per API process, bound here, so that an API process that is replaced reconnects."""
    ctx = zmq.asyncio.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(control[0])
    outbox.connect(control[1])
    sockets = []
    try:
        engine, error = _build_or_report(opts)
        if engine is None:
            await outbox.send(ipc.encoder.encode(ipc.StartFailed(error)))
            return
        for to_core, from_core in clients:
            sockets.append((ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)))
            sockets[-1][0].bind(to_core)
            sockets[-1][1].bind(from_core)
        core = EngineCore(engine, inbox, sockets)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, core.stopping.set)
        watch_parent(parent_pid, lambda: loop.call_soon_threadsafe(core.stopping.set))
        await outbox.send(ipc.encoder.encode(ipc.Ready(engine.info())))
        try:
            await core.run()
        finally:
            engine.stop()
    finally:
        for sock in (inbox, *(s for pair in sockets for s in pair)):
            sock.close(linger=0)
        outbox.close(linger=1000)  # StartFailed must still reach the starting process
        ctx.term()


def _build_or_report(opts: EngineOptions) -> tuple[object | None, str]:
    """(the started engine, '') or (None, why it could not start)."""
    try:
        return build_engine(opts), ""
    except EngineStartError as exc:
        return None, str(exc)
    except Exception as exc:
        log.exception("the engine could not start")
        return None, f"the engine could not start: {type(exc).__name__}: {exc}"
