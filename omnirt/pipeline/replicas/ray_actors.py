"""Stage replicas as Ray actors (`distributed: ray`).

Ray places each actor by its resource needs (one GPU per replica on an accelerator, or the
stage's `ray_resources`), so a pool can span the hosts of a Ray cluster. Messages and payloads
travel as actor-call arguments and results, i.e. through Ray's object store (small ones inline);
a sequence number keeps them in order whatever order Ray resolves them in. An actor error is
handled like a dead process: the pool fails or replays its requests and starts a new actor.
Ray is optional (`pip install 'omnirt[ray]'`); to span hosts, start a cluster (`ray start
--head`, then `ray start --address ...` on the others) and set RAY_ADDRESS before `omnirt serve`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from omnirt.pipeline.replicas.worker import HEARTBEAT_S, StageHost, StepReport, WorkerSpec
from omnirt.pipeline.stage.messages import StageMessage

log = logging.getLogger(__name__)


class RayUnavailableError(RuntimeError):
    pass


def require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError("distributed: ray needs Ray, an optional extra: pip install 'omnirt[ray]'") from exc
    return ray


class StageActor:
    """The actor body (wrapped with `ray.remote` at first use): a `StageHost` fed in sequence order."""

    def __init__(self, spec: WorkerSpec):
        self._reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
        self._pending: dict[int, StageMessage] = {}
        self._next_seq = 0
        self.host = StageHost(spec, self._reports.put)
        self.host.start()

    async def send(self, seq: int, msg: StageMessage) -> None:
        self._pending[seq] = msg
        while self._next_seq in self._pending:
            self.host.send(self._pending.pop(self._next_seq))
            self._next_seq += 1

    async def poll(self, timeout_s: float) -> list[StepReport]:
        """The reports since the last poll, waiting up to `timeout_s` for the first."""
        deadline = time.monotonic() + timeout_s
        while self._reports.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        out = []
        while not self._reports.empty():
            out.append(self._reports.get())
        return out

    async def pid(self) -> int:
        return os.getpid()

    async def stop(self) -> None:
        self.host.stop()


_remote_actor: Any = None


def _actor_class(ray: Any) -> Any:
    global _remote_actor  # wrapped once per process: ray.remote needs Ray imported
    if _remote_actor is None:
        _remote_actor = ray.remote(StageActor)
    return _remote_actor


def actor_resources(platform: str, overrides: dict[str, float]) -> dict[str, Any]:
    """What one replica asks Ray for: a CPU, plus one accelerator where there is one."""
    need: dict[str, Any] = {"num_cpus": 1}
    if platform in ("cuda", "rocm", "xpu"):
        need["num_gpus"] = 1
    elif platform == "npu":
        need["resources"] = {"NPU": 1}
    return {**need, **overrides}


class RayReplica:
    """The engine's handle on one Ray actor; same contract as `worker.ProcessReplica`."""

    kind = "ray"

    def __init__(self, spec: WorkerSpec, on_report: Callable, on_death: Callable):
        self.spec, self.on_report, self.on_death = spec, on_report, on_death
        self.actor: Any = None
        self.pid: int | None = None
        self._seq = 0
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        ray = require_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        sc = self.spec.cfg.stage(self.spec.stage)
        opts = actor_resources(self.spec.cfg.platform, sc.ray_resources)
        # Ray assigns the device (it sets the visible-devices variable); the profile index is not pinned.
        spec = dataclasses.replace(self.spec, pin_device=False)
        self.actor = _actor_class(ray).options(max_concurrency=4, max_restarts=0, **opts).remote(spec)
        self._reader = threading.Thread(target=self._read, args=(ray,), daemon=True,
                                        name=f"omnirt-{self.spec.stage}-{self.spec.replica}-ray")
        self._reader.start()

    def send(self, msg: StageMessage) -> None:
        with self._lock:  # seq order == call order
            self.actor.send.remote(self._seq, msg)
            self._seq += 1

    def stop(self) -> None:
        self._stopping = True
        ray = require_ray()
        if self.actor is not None:
            try:
                ray.get(self.actor.stop.remote(), timeout=10)
            except Exception:  # already dead or stuck: kill below either way
                pass
            ray.kill(self.actor)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)

    def _read(self, ray: Any) -> None:
        while not self._stopping:
            try:
                reports = ray.get(self.actor.poll.remote(HEARTBEAT_S), timeout=30)
                if self.pid is None and reports:
                    self.pid = ray.get(self.actor.pid.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as exc:
                if not self._stopping:
                    self.on_death(self, f"Ray actor failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                return
            for report in reports:
                self.on_report(self, report)
