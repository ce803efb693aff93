"""Between `--api-workers` processes: each listens on a Unix socket of its own for its siblings, who ask it
for its /metrics figures (`GET /metrics` on any worker sums every worker's) or hand it a request that only
it can serve (a WebRTC hangup: the call lives where its offer arrived). One JSON line in, bytes out."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from omnirt.app.ops.metrics import Metrics

log = logging.getLogger(__name__)
ASK_TIMEOUT_S = 5.0  # a sibling that does not answer within this is left out (being replaced, or stuck)
Handler = Callable[[dict], Awaitable[bytes]]


@dataclass(slots=True, frozen=True)
class WorkerContext:
    """What an API worker knows of its siblings (built by the supervisor, picklable)."""

    index: int
    count: int
    run_dir: str  # the workers' link sockets and the shared state's socket
    authkey: bytes  # for the shared state (omnirt.app.ops.shared)

    @property
    def shared_address(self) -> str:
        return os.path.join(self.run_dir, "shared.sock")

    def link_path(self, worker: int) -> str:
        return os.path.join(self.run_dir, f"worker-{worker}.sock")


class WorkerLink:
    def __init__(self, ctx: WorkerContext, metrics: Metrics):
        self.ctx, self.metrics = ctx, metrics
        self.handlers: dict[str, Handler] = {"metrics": self._local_metrics}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.ctx.link_path(self.ctx.index))  # left by the worker this one replaces
        self._server = await asyncio.start_unix_server(self._serve, self.ctx.link_path(self.ctx.index))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def ask_others(self, op: str, **fields) -> list[tuple[int, bytes]]:
        """(worker, answer) from every sibling that answered."""
        others = [k for k in range(self.ctx.count) if k != self.ctx.index]
        answers = await asyncio.gather(*(self._ask(k, {"op": op, **fields}) for k in others))
        return [(k, a) for k, a in zip(others, answers, strict=True) if a is not None]

    async def merged_metrics(self) -> bytes:
        """Every worker's figures summed (process_* labelled by worker), then the engine's once."""
        texts = [(self.ctx.index, self.metrics.render_local()), *await self.ask_others("metrics")]
        return merge_metrics(texts) + generate_latest(self.metrics.engine_registry)

    async def _local_metrics(self, _: dict) -> bytes:
        return self.metrics.render_local()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await reader.readline())
            writer.write(await self.handlers[request["op"]](request))
            await writer.drain()
        except Exception:  # a sibling's bad line must not end this worker's link
            log.exception("worker link: a request failed")
        finally:
            writer.close()

    async def _ask(self, worker: int, request: dict) -> bytes | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.ctx.link_path(worker)),
                                                    ASK_TIMEOUT_S)
        except (OSError, TimeoutError):
            return None  # not up (being started or replaced)
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            return await asyncio.wait_for(reader.read(), ASK_TIMEOUT_S)
        except (OSError, TimeoutError):
            log.warning("worker link: worker %d did not answer %r", worker, request["op"])
            return None
        finally:
            writer.close()


def merge_metrics(texts: list[tuple[int, bytes]]) -> bytes:
    """Prometheus texts of several workers as one: samples of the same name and labels summed (counters,
    gauges, histogram buckets); process_* samples kept apart with a `worker` label; `_created` dropped."""
    families: dict[str, Metric] = {}
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for worker, text in texts:
        for fam in text_string_to_metric_families(text.decode()):
            families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = {**sample.labels, "worker": str(worker)} if fam.name.startswith("process_") else sample.labels
                sums[fam.name][(sample.name, tuple(sorted(labels.items())))] += sample.value
    for name, fam in families.items():
        for (sample_name, labels), value in sums[name].items():
            fam.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry()
    registry.register(_Families([fam for fam in families.values() if fam.samples]))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
