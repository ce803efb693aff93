"""Shared by the replica tests (worker processes and Ray): a pooled tiny engine, a request runner,
and a recorder of which replica reported each request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from omnirt.pipeline.api import AudioChunk, Finished, OmniRequest, TextDelta

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a story about a dragon.", "Hello there, how are you?", "Numbers 1 2 3 4 5",
           "A brave knight and a castle", "What is in this audio clip?", "The quick brown fox"]


@dataclass
class Result:
    text: str = ""
    pcm: bytes = b""
    finish: Finished | None = None
    num_chunks: int = 0
    first_audio_at: float | None = None


async def run(engine, rid: str, text: str, talker_tokens: int = 30, min_tokens: int = 0,
              started: asyncio.Event | None = None) -> Result:
    req = OmniRequest(rid, [{"role": "user", "content": text}], ("text", "audio"),
                      thinker_sampling={"max_tokens": 8 + len(text) % 5},
                      talker_sampling={"max_tokens": talker_tokens, "min_tokens": min_tokens})
    res, pcm = Result(), bytearray()
    async for ev in await engine.submit(req):
        if isinstance(ev, TextDelta):
            res.text += ev.text
        elif isinstance(ev, AudioChunk):
            pcm += ev.pcm16
            res.num_chunks += 1
            if started is not None:
                started.set()
        elif isinstance(ev, Finished):
            res.finish = ev
    res.pcm = bytes(pcm)
    return res


def max_pcm_diff(a: bytes, b: bytes) -> int:
    return max((abs(x - y) for x, y in zip(memoryview(a).cast("h"), memoryview(b).cast("h"))), default=0)


@dataclass
class Routing:
    """Which replica of each pool reported outputs for each request (installed on the replica handles)."""

    seen: dict[tuple[str, str], set[int]] = field(default_factory=lambda: defaultdict(set))

    def install(self, engine) -> None:
        for pool in (engine.stage("talker"), engine.stage("code2wav")):
            for slot in pool._slots:
                self.wrap(pool.name, slot.handle)

    def wrap(self, stage: str, handle) -> None:
        inner = handle.on_report

        def on_report(h, report):
            for rid, *_ in report.result.outputs:
                self.seen[(stage, rid)].add(h.spec.replica)
            inner(h, report)

        handle.on_report = on_report

    def replicas_of(self, stage: str, rid: str) -> set[int]:
        return self.seen[(stage, rid)]


def pooled_config(extra: dict | None = None, **stage_extra):
    from tests.profiles import load_profile

    pool = {"num_replicas": 2, "devices": "0,1", **stage_extra}
    return load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu", extra or {}, {"1": pool, "2": pool})


def start_engine(cfg):
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    eng = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    eng.start()
    return eng


async def wait_for(predicate, timeout: float, what: str) -> float:
    """Poll `predicate` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def replica(engine, stage: str, index: int) -> dict:
    return engine.replica_status()[stage][index]
