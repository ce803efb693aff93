"""A stage served out of the engine's process: what runs there (`StageHost`, `worker_main`) and the
engine's handle on one such worker process (`ProcessReplica`).

The host builds the ordinary in-process `Stage` from its own copy of the models and sends each
step's `StepResult` (the same type an in-process stage reports) in a `StepReport` with its load;
the engine side hands the result on unchanged, so the stage graph does not care where a stage runs.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from omnirt.pipeline.config import EngineConfig
from omnirt.pipeline.models import load_models
from omnirt.pipeline.platform import get_platform
from omnirt.pipeline.replicas.channel import Channel, ChannelClosed, remove_driver_files
from omnirt.pipeline.stage.loop import build_stage
from omnirt.pipeline.stage.messages import Command, StageMessage
from omnirt.pipeline.stage.step import StepResult

log = logging.getLogger(__name__)
HEARTBEAT_S = 0.2
HANG_TIMEOUT_S = 10.0
PARENT_POLL_S = 0.25  # an up worker silent this long (no step, no heartbeat) is killed, then handled as dead


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """Everything a replica needs to build its stage, wherever it runs."""

    stage: str
    replica: int
    device_index: int
    cfg: EngineConfig
    num_threads: int = 1
    pin_device: bool = True  # False where the runtime (Ray) assigns the device
    ring_bytes: int = 64 * 2**20  # each transport ring (host, and device where the platform shares device memory)
    device_ipc: bool = True  # False: device tensors are staged through host memory (the ablation)


@dataclass(slots=True)
class ReplicaLoad:
    num_waiting: int = 0
    num_running: int = 0
    num_free_slots: int = 0
    num_slots: int = 0
    num_steps: int = 0
    num_consumed: int = 0  # messages applied so far; the engine's sent count minus this is the inbox backlog


@dataclass(slots=True, frozen=True)
class DeviceLink:
    """A worker's first message: the handles of the device memory behind both of its channels' device
    rings, for the engine to open (where the platform shares device memory between processes)."""

    inbox: tuple
    outbox: tuple


@dataclass(slots=True)
class StepReport:
    """One step of a replica (or a heartbeat when its result is empty)."""

    result: StepResult = field(default_factory=StepResult)
    load: ReplicaLoad | None = None
    is_ready: bool = False


class StageHost:
    """The worker side: one stage, fed by `send`, reporting every step through `emit`."""

    def __init__(self, spec: WorkerSpec, emit: Callable[[StepReport], None]):
        platform = get_platform(spec.cfg.platform)
        if spec.pin_device:
            platform.pin_device(spec.device_index)
        torch.set_num_threads(spec.num_threads)
        self.device = platform.device(0)  # the pinned device is the only one this process sees
        self.emit = emit
        self.num_consumed = 0
        self.models = load_models(spec.cfg, platform, (spec.stage,))  # this stage's weights only
        self.stage = build_stage(spec.stage, spec.cfg, self.models, self._on_step)
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"omnirt-{spec.stage}-beat", daemon=True)

    def start(self) -> None:
        self.models.capture_cuda_graphs()  # this stage's graphs only
        self.stage.start()
        self._beat.start()
        self.emit(StepReport(load=self.load(), is_ready=True))

    def send(self, msg: StageMessage) -> None:
        if msg.command is Command.INPUTS:
            self.stage.send_inputs(msg.payload)
        else:
            self.stage.send(msg)
        self.num_consumed += 1

    def stop(self) -> None:
        self._stopped.set()
        self.stage.stop()
        self._beat.join(timeout=5)

    def load(self) -> ReplicaLoad:
        sched = self.stage.scheduler
        return ReplicaLoad(sched.num_waiting, sched.num_running, sched.num_free_slots, sched.num_slots,
                           self.stage.counters.num_steps, self.num_consumed)

    def _on_step(self, stage: str, result: StepResult) -> None:
        self.emit(StepReport(result, self.load()))

    def _heartbeat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            self.emit(StepReport(load=self.load()))


def watch_parent(parent_pid: int, on_gone: Callable[[], None]) -> None:
    """The parent died without telling us (SIGKILL, crash): `on_gone()`, so that no orphan outlives it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.warning("parent process %d is gone; stopping", parent_pid)
        on_gone()

    threading.Thread(target=watch, name="omnirt-parent-watch", daemon=True).start()


def _exit_orphaned() -> None:
    remove_driver_files(os.getpid())  # nobody is left to do it once we are gone
    os._exit(1)


def worker_main(spec: WorkerSpec, inbox_spec: tuple, outbox_spec: tuple, parent_pid: int) -> None:
    """Entry point of a spawned worker process: serve one stage until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the engine leads the stop
    watch_parent(parent_pid, _exit_orphaned)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {spec.stage}[{spec.replica}] "
                                                      "%(name)s: %(message)s")
    logging.getLogger("omnirt.memory").setLevel(logging.INFO)  # its memory plan, as the engine's own stages log it
    host = StageHost(spec, lambda report: outbox.put(report))  # reports start with `host.start()`
    outbox = Channel.attach(outbox_spec, host.device)
    inbox = Channel.attach(inbox_spec, host.device, consumer_stream=host.stage.stream)
    if inbox.device_ring is not None and outbox.device_ring is not None:
        outbox.put(DeviceLink(inbox.device_handle(), outbox.device_handle()))
    host.start()
    while (msg := inbox.get()) is not None:
        host.send(msg)
    host.stop()
    inbox.close()
    outbox.close()


class ProcessReplica:
    """The engine's handle on one worker process: its channels, its reader thread, its liveness.

    `on_report(replica, report)` and `on_death(replica, reason)` are called from the reader thread;
    a dead process is noticed within `HEARTBEAT_S` (the reader polls the process between reads), a
    hung one (no report for `HANG_TIMEOUT_S`) is killed and then handled as dead."""

    kind = "process"

    def __init__(self, spec: WorkerSpec, on_report: Callable, on_death: Callable):
        self.spec, self.on_report, self.on_death = spec, on_report, on_death
        self.process: Any = None
        self.inbox: Channel | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        device_ring = self.spec.device_ipc and get_platform(self.spec.cfg.platform).ipc_transport == "cuda_ipc"
        self.inbox = Channel.create(ctx.Queue(), self.spec.ring_bytes, device_ring)
        self.outbox = Channel.create(ctx.Queue(), self.spec.ring_bytes, device_ring)
        self.process = ctx.Process(target=worker_main, args=(self.spec, self.inbox.spec(), self.outbox.spec(),
                                                             os.getpid()),
                                   name=f"omnirt-{self.spec.stage}-{self.spec.replica}", daemon=True)
        self.process.start()
        self._reader = threading.Thread(target=self._read, name=f"omnirt-{self.spec.stage}-{self.spec.replica}-rx",
                                        daemon=True)
        self._stopping = False
        self._reader.start()

    def send(self, msg: StageMessage) -> None:
        self.inbox.put(msg)

    def stop(self) -> None:
        self._stopping = True
        if self.process is not None and self.process.is_alive():
            for ch in (self.inbox, self.outbox):
                ch.unmap_device_ring()  # nothing is in flight now; the worker owns that memory
            self.inbox.put_end()
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        if self.inbox is not None:
            self._close_channels()

    def mark_dead(self) -> None:
        """Unblock writers waiting on a ring nobody reads any more."""
        if self.inbox is not None:
            self.inbox.mark_closed()

    def _read(self) -> None:
        last_report = None  # monotonic time of the last report; None until the worker is up
        while not self._stopping:
            try:
                report = self.outbox.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                report = None
            except (EOFError, OSError, ChannelClosed):  # the pipe broke, or we are stopping: the process is going
                report = None
                time.sleep(HEARTBEAT_S)
            if isinstance(report, DeviceLink):
                self.inbox.open_device_ring(report.inbox)
                self.outbox.open_device_ring(report.outbox)
            elif report is not None:
                last_report = time.monotonic()
                self.on_report(self, report)
            elif last_report is not None and time.monotonic() - last_report > HANG_TIMEOUT_S:
                log.error("%s replica %d: no heartbeat for %.0f s; killing process %d", self.spec.stage,
                          self.spec.replica, HANG_TIMEOUT_S, self.process.pid)
                self.process.kill()
                last_report = None
            elif not self.process.is_alive() and not self._stopping:
                self.mark_dead()
                self.process.join()
                self.on_death(self, f"process {self.process.pid} exited with code {self.process.exitcode}")
                self._close_channels()
                return

    def _close_channels(self) -> None:
        """Unlink both rings (a restart makes new ones) and what the driver left for the exited process."""
        for ch in (self.inbox, self.outbox):
            if ch is not None:
                ch.close()
        self.inbox = self.outbox = None
        if self.process is not None and self.process.exitcode is not None:
            remove_driver_files(self.process.pid)
