"""`omnirt serve --api-workers N`: N API processes on one port, all submitting to one engine core, as
vLLM runs several API servers in front of one EngineCore.

The supervising process (`supervise`) holds the port (bound, not listening), starts the engine core for
N clients and serves the state the limits share (`omnirt.app.ops.shared`); then it spawns the workers. Each
worker is a whole API process (its own event loop, uvicorn, sessions, VAD batcher) that binds the port
with SO_REUSEPORT, so the kernel spreads new connections over the workers (Linux), and reaches its
siblings through `omnirt.app.ops.worker_link`. A WebSocket session or a WebRTC call lives in the worker that
took its connection (for WebRTC: the offer, and so the call's UDP ports).

- SIGTERM or SIGINT to the supervisor: every worker drains as one server does, then the core stops.
  SIGHUP is passed on (each worker re-reads the keys file).
- A worker that dies: the core aborts its requests, what it held in the shared limits is freed, its
  connections drop (their clients see the connection close), and a new worker takes its place. One that
  dies before it ever served stops the server (exit status 1): it would only die again.
- The core that dies: every worker ends its streams with an error and exits, then the supervisor
  (exit status 1), as one API process does.
- The supervisor that dies (SIGKILL): the core and the workers notice and stop.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from omnirt.app import api_process
from omnirt.app.ops import shared
from omnirt.app.ops.lifecycle import DrainingServer
from omnirt.app.ops.logs import setup as setup_logs
from omnirt.app.ops.worker_link import WorkerContext
from omnirt.pipeline.api import EngineOptions, EngineStartError, connect_engine, start_core

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the supervisor looks at its children, and a worker at its supervisor


def supervise(args: argparse.Namespace, opts: EngineOptions, sock: socket.socket, ready_line) -> int:
    """Run the core and `args.api_workers` workers until told to stop; the exit status. `ready_line(info)`:
    what to print once every worker serves."""
    run_dir = tempfile.mkdtemp(prefix="omnirt-api-")
    authkey = secrets.token_bytes(16)
    limits, _, stop_shared = shared.serve(os.path.join(run_dir, "shared.sock"), authkey)
    try:
        core = start_core(opts, args.api_workers, log_setup=setup_logs)
    except EngineStartError as exc:
        stop_shared()
        shutil.rmtree(run_dir, ignore_errors=True)
        sys.exit(f"omnirt: {exc}")
    try:
        return Supervisor(args, core, limits, run_dir, authkey, sock.getsockname()[1]).run(ready_line)
    finally:
        core.stop()
        stop_shared()
        sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


class Supervisor:
    def __init__(self, args: argparse.Namespace, core, limits: shared.SharedLimits, run_dir: str, authkey: bytes,
                 port: int):
        self.args, self.core, self.limits, self.run_dir, self.authkey, self.port = (
            args, core, limits, run_dir, authkey, port)
        self.workers: list[mp.Process | None] = [None] * args.api_workers
        self.is_stopping = self.is_core_dead = self.is_ready = False
        self.exit_status = 0

    def run(self, ready_line) -> int:
        for k in range(len(self.workers)):
            self._spawn(k)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        while any(self.workers):
            mp.connection.wait([p.sentinel for p in self.workers if p] + [self.core.sentinel], POLL_S)
            if not self.core.is_alive() and not self.is_core_dead:
                log.error("%s; the API workers stop", self.core.exit_reason())
                self.is_core_dead, self.exit_status = True, 1
            for k, proc in enumerate(self.workers):
                if proc is not None and not proc.is_alive():
                    self._exited(k)
            if not self.is_ready and len(self.limits.ready_workers()) == len(self.workers):
                self.is_ready = True
                print(ready_line(self.core.info), flush=True)
        return self.exit_status

    def _spawn(self, k: int) -> None:
        ctx = WorkerContext(k, len(self.workers), self.run_dir, self.authkey)
        proc = mp.get_context("spawn").Process(target=worker_main, name=f"omnirt-api-{k}",
                                               args=(self.args, self.core.handle(k), ctx, self.port, os.getpid()))
        proc.start()
        self.workers[k] = proc
        log.info("API worker %d started (pid %d)", k, proc.pid)

    def _exited(self, k: int) -> None:
        proc, self.workers[k] = self.workers[k], None
        had_served = k in self.limits.ready_workers()
        self.limits.forget_worker(k)
        self.core.client_gone(k)
        if self.is_stopping or self.is_core_dead:
            return
        if not had_served:
            log.error("API worker %d exited with code %s before it served; the server stops", k, proc.exitcode)
            self.exit_status = 1
            self._stop()
            return
        log.error("API worker %d (pid %d) exited with code %s; its connections are gone; starting another", k,
                  proc.pid, proc.exitcode)
        self._spawn(k)

    def _on_signal(self, sig: int, _frame) -> None:
        if sig == signal.SIGHUP:
            self._signal_workers(signal.SIGHUP)
        else:
            self._stop()

    def _stop(self) -> None:
        """Every worker drains (a second signal: they stop at once, as one server does)."""
        self.is_stopping = True
        self._signal_workers(signal.SIGTERM)

    def _signal_workers(self, sig: int) -> None:
        for proc in self.workers:
            if proc is not None and proc.pid is not None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass


class WorkerServer(DrainingServer):
    """A worker's uvicorn: SIGINT is the supervisor's to act on (Ctrl-C reaches the whole group), which passes
    it on as one SIGTERM; two would cut the drain short."""

    def handle_exit(self, sig, frame) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def worker_main(args: argparse.Namespace, handle, ctx: WorkerContext, port: int, supervisor_pid: int) -> None:
    """Entry point of a spawned API worker: one API process on the shared port, serving until told to stop."""
    setup_logs(args.log_level, args.log_format)
    engine = connect_engine(handle)
    app = api_process.build_app(args, engine, handle.info, ctx)
    sock = api_process.listen(args.host, port, reuse_port=True)
    threading.Thread(target=_watch_supervisor, args=(supervisor_pid,), name="omnirt-supervisor-watch",
                     daemon=True).start()
    api_process.serve(app, args, sock, engine, server_class=WorkerServer)
    if not engine.health().is_alive:
        sys.exit(1)


def _watch_supervisor(pid: int) -> None:
    """The supervisor died without telling us (SIGKILL): drain and stop, as on SIGTERM."""
    while os.getppid() == pid:
        time.sleep(POLL_S)
    log.warning("the supervising process %d is gone; this worker stops", pid)
    os.kill(os.getpid(), signal.SIGTERM)
