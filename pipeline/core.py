"""The engine core: build the engine from `EngineOptions`, and serve it in a process of its own.

The core process owns the stages, their step loops and every tensor; the API process only moves
bytes. They talk over two ZeroMQ sockets (`pipeline/ipc.py`): requests and aborts in, and out one
batched `Outputs` message per burst of events plus an `EngineStats` snapshot every `STATS_S`, which
is also the heartbeat. The core stops when told to, on SIGTERM, or when the API process is gone.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

import zmq
import zmq.asyncio

from pipeline import ipc
from pipeline.api import EngineOptions, EngineOverloaded, EngineStartError, OmniRequest, RequestError
from pipeline.config import AR_STAGES
from pipeline.worker import watch_parent

log = logging.getLogger("omnirt.core")
STATS_S = 0.2  # stats snapshot (and heartbeat) period
MAX_PENDING_BYTES = 16 * 2**20  # events queued for one send: request tasks wait beyond this


def build_engine(opts: EngineOptions):
    """Profile -> platform merge -> models -> started engine. Raises EngineStartError."""
    from pipeline.config import ProfileError, engine_config, profile_path
    from pipeline.models import ModelNotFoundError, load_models
    from pipeline.platform import detect_platform, get_platform, set_num_threads
    from pipeline.ray_replica import RayUnavailableError, require_ray

    if opts.threads:
        set_num_threads(opts.threads)
    try:
        platform = get_platform(opts.platform) if opts.platform else detect_platform()
        cfg = engine_config(opts, platform.name)
        if cfg.distributed == "ray":
            require_ray()  # fail before loading weights when the extra is missing
        _log_plan(platform.name, profile_path(opts), cfg)
        local = tuple(s.name for s in cfg.stages if opts.engine == "reference" or not s.needs_workers)
        models = load_models(cfg, platform, local)  # stages in replica workers load there
        cfg.check_voices(sorted(models.voices))
    except (ProfileError, ModelNotFoundError, RayUnavailableError, ValueError) as exc:
        raise EngineStartError(str(exc)) from exc
    return _start(opts.engine, cfg, models)


def _log_plan(platform: str, profile, cfg) -> None:
    log.info("platform %s, profile %s, model %s (%s, %s)", platform, profile, cfg.model, cfg.load_format, cfg.dtype)
    for s in cfg.stages:
        context = f" max_model_len={s.max_model_len}" if s.name in AR_STAGES else ""
        log.info("stage %d %-8s max_num_seqs=%d%s eager=%s devices=%s", s.stage_id, s.name, s.max_num_seqs, context,
                 s.enforce_eager, s.devices)


def _start(kind: str, cfg, models):
    from pipeline.engine import OmniEngine
    from pipeline.models.qwen3_omni.reference import ReferenceEngine

    engine = (ReferenceEngine if kind == "reference" else OmniEngine)(cfg, models)
    try:
        engine.start()
    except RuntimeError as exc:  # a replica that did not come up
        engine.stop()
        raise EngineStartError(str(exc)) from exc
    return engine


class EngineCore:
    """The core's event loop: requests in, events out, batched per burst."""

    def __init__(self, engine, inbox: zmq.asyncio.Socket, outbox: zmq.asyncio.Socket):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._pending: list = []
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        """Until told to stop; a loop that fails ends the core (the API process sees it die, never a hang)."""
        loops = [asyncio.create_task(self._send_loop()), asyncio.create_task(self._recv_loop())]
        stop = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([*loops, stop], return_when=asyncio.FIRST_COMPLETED)
        for task in (*loops, stop):
            task.cancel()
        for task in done & set(loops):
            task.result()  # raises what ended it

    async def _recv_loop(self) -> None:
        while True:
            msg = ipc.to_core.decode(await self.inbox.recv())
            if isinstance(msg, OmniRequest):
                task = asyncio.create_task(self._serve(msg.request_id, self._submit(msg)))
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

    async def _serve(self, rid: str, submitted) -> None:
        try:
            events = await submitted
        except RequestError as exc:
            return self._emit(ipc.Rejected(rid, "invalid", str(exc), exc.param, exc.code))
        except EngineOverloaded as exc:
            return self._emit(ipc.Rejected(rid, "overloaded", str(exc), stage=exc.stage, capacity=exc.capacity,
                                           retry_after_s=exc.retry_after_s))
        except Exception as exc:
            log.exception("request %s: submit failed", rid)
            return self._emit(ipc.Rejected(rid, "internal", f"the request could not start ({type(exc).__name__})",
                                           code="internal_error"))
        self._emit(ipc.Accepted(rid))
        async for ev in events:
            self._emit(ev)
            if self._pending_bytes > MAX_PENDING_BYTES:  # the API process is not reading: hold this request
                await self._drained.wait()

    def _emit(self, item) -> None:
        self._pending.append(item)
        self._pending_bytes += ipc.num_bytes(item)
        self._wake.set()

    async def _send_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_stats = loop.time()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_stats - loop.time()))
            except TimeoutError:
                pass
            self._wake.clear()
            if self._pending:
                items, self._pending, self._pending_bytes = self._pending, [], 0
                self._drained.set()
                self._drained.clear()
                await self.outbox.send(ipc.encoder.encode(ipc.Outputs(items)), copy=False)
            if loop.time() >= next_stats:
                next_stats = loop.time() + STATS_S
                await self.outbox.send(ipc.encoder.encode(self.engine.stats()))


async def _raise(exc: Exception):
    raise exc


def core_main(opts: EngineOptions, to_core: str, from_core: str, parent_pid: int,
              log_setup: Callable[[str, str], None] | None = None) -> None:
    """Entry point of the spawned engine core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process leads the stop
    if log_setup is not None:
        log_setup(opts.log_level, opts.log_format)
    asyncio.run(_serve_core(opts, to_core, from_core, parent_pid))


async def _serve_core(opts: EngineOptions, to_core: str, from_core: str, parent_pid: int) -> None:
    ctx = zmq.asyncio.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(to_core)
    outbox.connect(from_core)
    try:
        engine, error = _build_or_report(opts)
        if engine is None:
            await outbox.send(ipc.encoder.encode(ipc.StartFailed(error)))
            return
        core = EngineCore(engine, inbox, outbox)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, core.stopping.set)
        watch_parent(parent_pid, lambda: loop.call_soon_threadsafe(core.stopping.set))
        await outbox.send(ipc.encoder.encode(ipc.Ready(engine.info())))
        try:
            await core.run()
        finally:
            engine.stop()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)  # StartFailed must still reach the API process
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
