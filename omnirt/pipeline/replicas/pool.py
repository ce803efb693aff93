"""A pool of replicas of one stage, behind the same interface as an in-process `Stage`.

Routing: a request sticks to the replica that got its ADD until it finishes there; a new request
goes to the least-loaded live replica (requests bound to it + messages it has not applied yet),
or round-robin. A replica that dies (process exit, Ray actor error) is noticed by its reader
within a heartbeat: each of its requests is replayed on another replica when nothing has come
back for it yet (the pool keeps the messages sent until the first report), otherwise it ends with
an error naming the replica; the pool restarts the replica with exponential backoff.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnirt.pipeline.config import EngineConfig, ProfileError
from omnirt.pipeline.platform import get_platform
from omnirt.pipeline.replicas.ray_actors import RayReplica
from omnirt.pipeline.replicas.worker import ProcessReplica, ReplicaLoad, StepReport, WorkerSpec
from omnirt.pipeline.stage.graph import LoadedModels
from omnirt.pipeline.stage.loop import StepSink, build_stage
from omnirt.pipeline.stage.messages import Command, StageMessage
from omnirt.pipeline.stage.protocols import StageHandle
from omnirt.pipeline.stage.request import RequestStatus
from omnirt.pipeline.stage.step import Finish, StepResult
from omnirt.pipeline.types import StageStats

log = logging.getLogger(__name__)
BACKOFF_S = (0.5, 10.0)  # first restart delay, cap (doubling per consecutive failure)
HEALTHY_RESET_S = 30.0  # up this long: the next failure starts the backoff again from the first delay
READY_TIMEOUT_S = 180.0


class ReplicaHandle(Protocol):
    """The pool's handle on one replica: a worker process (`ProcessReplica`) or a Ray actor (`RayReplica`). It
    calls back `on_report(handle, StepReport)` and `on_death(handle, reason)` from a reader thread of its own."""

    kind: str
    spec: WorkerSpec

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def send(self, msg: StageMessage) -> None: ...


ReplicaFactory = Callable[[WorkerSpec, Callable, Callable], ReplicaHandle]


class ReplicaState(enum.Enum):
    STARTING = "starting"
    UP = "up"
    DEAD = "dead"  # waiting for its restart


@dataclass(slots=True)
class _Slot:
    """One replica position of the pool; its handle is replaced on restart."""

    index: int
    handle: ReplicaHandle
    state: ReplicaState = ReplicaState.STARTING
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    num_sent: int = 0
    num_restarts: int = 0
    num_failures: int = 0  # consecutive, for the backoff
    up_since: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)
    last_error: str | None = None

    @property
    def backlog(self) -> int:
        return max(0, self.num_sent - self.load.num_consumed)


class ReplicaPool:
    def __init__(self, name: str, specs: list[WorkerSpec], on_step: StepSink, routing: str = "least_loaded",
                 replica_cls: ReplicaFactory = ProcessReplica):
        self.name, self.on_step, self.routing = name, on_step, routing
        self._replica_cls = replica_cls
        self._slots = [_Slot(s.replica, replica_cls(s, self._on_report, self._on_death)) for s in specs]
        self.requests: dict[str, int] = {}  # request id -> replica index (sticky)
        self._replay: dict[str, list[StageMessage]] = {}  # sent so far, kept until the first report
        self._lock = threading.RLock()
        self._rr = itertools.cycle(range(len(self._slots)))
        self._stopping = False

    # ---- the stage handle (`StageHandle`) ---------------------------------------------------------------

    def start(self) -> None:
        for slot in self._slots:
            slot.handle.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for slot in self._slots:
            while not slot.ready.wait(0.1):
                if slot.last_error is not None or time.monotonic() > deadline:
                    self.stop()
                    why = slot.last_error or f"not up after {READY_TIMEOUT_S:.0f} s (Ray: are its resources free?)"
                    raise RuntimeError(f"{self.name} replica {slot.index} did not start: {why}")

    def stop(self) -> None:
        self._stopping = True
        for slot in self._slots:
            slot.handle.stop()

    def send(self, msg: StageMessage) -> None:
        with self._lock:
            if msg.command is Command.ADD:
                slot = self._pick()
                if slot is None:
                    self._report_failed([msg.request_id], f"no {self.name} replica is available")
                    return
                self.requests[msg.request_id] = slot.index
                self._replay[msg.request_id] = [msg]
            else:
                index = self.requests.get(msg.request_id)
                if index is None:
                    return  # finished (or never added) here
                slot = self._slots[index]
                if msg.request_id in self._replay:
                    self._replay[msg.request_id].append(msg)
            self._deliver(slot, msg)

    def send_inputs(self, items: list[tuple[str, Any]]) -> None:
        """One upstream step's chunks: one message per replica for the whole step, not one per request."""
        by_slot: dict[int, list[tuple[str, Any]]] = {}
        with self._lock:
            for rid, payload in items:
                index = self.requests.get(rid)
                if index is None:
                    continue  # finished (or never added) here
                by_slot.setdefault(index, []).append((rid, payload))
                if rid in self._replay:
                    self._replay[rid].append(StageMessage(Command.INPUT, rid, payload))
            for index, batch in by_slot.items():
                self._deliver(self._slots[index], StageMessage(Command.INPUTS, "", batch))

    @property
    def num_free_slots(self) -> int:
        return sum(s.load.num_free_slots for s in self._slots if s.state is ReplicaState.UP)

    @property
    def num_slots(self) -> int:
        return sum(s.load.num_slots for s in self._slots if s.state is ReplicaState.UP)

    def stats(self) -> StageStats:
        """Its slots: each replica reports its own steps on /health (`replica_status`)."""
        return StageStats(self.name, self.num_free_slots, self.num_slots)

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: where it runs, its state and load (for /health and metrics)."""
        with self._lock:
            bound = self._bound_counts()
            return [{"replica": s.index, "kind": s.handle.kind, "device": s.handle.spec.device_index,
                     "state": s.state.value, "pid": s.handle.pid,
                     "active_requests": bound[s.index], "backlog": s.backlog, "running": s.load.num_running,
                     "waiting": s.load.num_waiting, "steps": s.load.num_steps, "restarts": s.num_restarts,
                     "last_error": s.last_error} for s in self._slots]

    # ---- routing ------------------------------------------------------------------------------------

    def _pick(self) -> _Slot | None:
        live = [s for s in self._slots if s.state is ReplicaState.UP] or \
               [s for s in self._slots if s.state is ReplicaState.STARTING]
        if not live:
            return None
        if self.routing == "round_robin":
            while True:
                slot = self._slots[next(self._rr)]
                if slot in live:
                    return slot
        bound = self._bound_counts()
        return min(live, key=lambda s: (bound[s.index] + s.backlog, s.index))

    def _bound_counts(self) -> dict[int, int]:
        counts = dict.fromkeys(range(len(self._slots)), 0)
        for index in self.requests.values():
            counts[index] += 1
        return counts

    def _deliver(self, slot: _Slot, msg: StageMessage) -> None:
        try:
            slot.handle.send(msg)
            slot.num_sent += 1
        except Exception as exc:  # a replica going away under us: its death handler settles the request
            log.warning("%s replica %d: send failed: %s", self.name, slot.index, exc)

    # ---- reports from replicas (reader threads) --------------------------------------------------------

    def _on_report(self, handle: Any, report: StepReport) -> None:
        slot = self._slots[handle.spec.replica]
        if slot.handle is not handle:
            return  # a report from a replica already replaced
        if report.load is not None:
            slot.load = report.load
        if report.is_ready:
            slot.state, slot.up_since = ReplicaState.UP, time.monotonic()
            slot.ready.set()
            log.info("%s replica %d is up (%s %s)", self.name, slot.index, handle.kind, handle.pid or "")
        result = report.result
        if not result.outputs and not result.finished:
            return
        with self._lock:
            for out in result.outputs:
                self._replay.pop(out.request_id, None)  # something came back: the request can no longer move
            for fin in result.finished:
                self._replay.pop(fin.request_id, None)
                self.requests.pop(fin.request_id, None)
        self.on_step(self.name, result)

    def _on_death(self, handle: Any, reason: str) -> None:
        slot = self._slots[handle.spec.replica]
        failed = []
        with self._lock:
            slot.state, slot.last_error = ReplicaState.DEAD, reason
            slot.load = ReplicaLoad(num_steps=slot.load.num_steps)
            log.error("%s replica %d died: %s", self.name, slot.index, reason)
            for rid in [r for r, i in self.requests.items() if i == slot.index]:
                other = self._pick()
                log_msgs = self._replay.get(rid)
                if log_msgs is not None and other is not None:
                    log.warning("%s: request %s moves to replica %d", self.name, rid, other.index)
                    self.requests[rid] = other.index
                    for msg in log_msgs:
                        self._deliver(other, msg)
                else:
                    self.requests.pop(rid, None)
                    self._replay.pop(rid, None)
                    failed.append(rid)
        self._report_failed(failed, f"{self.name} replica {slot.index} died mid-request ({reason})")
        if not self._stopping:
            self._schedule_restart(slot)

    def _report_failed(self, request_ids: list[str], error: str) -> None:
        if request_ids:
            self.on_step(self.name, StepResult(finished=[Finish(rid, RequestStatus.FINISHED_ERROR, 0, error)
                                                         for rid in request_ids]))

    def _schedule_restart(self, slot: _Slot) -> None:
        if slot.up_since and time.monotonic() - slot.up_since > HEALTHY_RESET_S:
            slot.num_failures = 0
        delay = min(BACKOFF_S[0] * 2 ** slot.num_failures, BACKOFF_S[1])
        slot.num_failures += 1
        timer = threading.Timer(delay, self._restart, args=(slot,))
        timer.daemon = True
        timer.start()

    def _restart(self, slot: _Slot) -> None:
        if self._stopping:
            return
        with self._lock:
            spec = slot.handle.spec
            slot.handle = self._replica_cls(spec, self._on_report, self._on_death)
            slot.state, slot.num_sent, slot.up_since = ReplicaState.STARTING, 0, 0.0
            slot.ready.clear()
            slot.num_restarts += 1
        log.warning("%s replica %d restarting (restart %d)", self.name, slot.index, slot.num_restarts)
        try:
            slot.handle.start()
        except Exception as exc:
            self._on_death(slot.handle, f"restart failed: {exc}")


# ---- placement --------------------------------------------------------------------------------------


def make_stage(name: str, cfg: EngineConfig, models: LoadedModels, on_step: StepSink) -> StageHandle:
    """The stage `name` as the profile places it: in this process (one replica on the engine's device),
    else a pool of worker processes, or of Ray actors with `distributed: ray`."""
    sc = cfg.stage(name)
    if not sc.needs_workers:
        return build_stage(name, cfg, models, on_step)
    _check_devices(cfg, name)
    threads = torch.get_num_threads()  # workers use the engine's intra-op thread count (--threads)
    specs = [WorkerSpec(name, i, sc.replica_device(i), cfg, threads, device_ipc=sc.device_ipc)
             for i in range(sc.num_replicas)]
    return ReplicaPool(name, specs, on_step, sc.routing, RayReplica if cfg.distributed == "ray" else ProcessReplica)


def _check_devices(cfg: EngineConfig, name: str) -> None:
    sc = cfg.stage(name)
    count = get_platform(cfg.platform).device_count()
    if count is not None and cfg.distributed == "none" and max(sc.device_ids) >= count:
        raise ProfileError(f"deploy profile: stages[{sc.stage_id}].devices {sc.devices!r} names a device this "
                           f"host does not have ({count} {cfg.platform} devices visible)")

