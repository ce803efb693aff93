"""Shared fixtures: one in-process tiny engine, and a real server subprocess on a free loopback port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors under its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
OMNIRT = [sys.executable, "-m", "omnirt.app.cli"]  # `omnirt` as this checkout runs it
ARTIFACTS = ROOT / "tests" / "artifacts"
# `make test-fast` (under 3 minutes, for the edit loop): the modules that start no server, browser or soak.
# `make test` (CI) runs everything.
FAST_MODULES = {"test_batching", "test_config", "test_cudagraph", "test_parity", "test_platform",
                "test_realtime_units", "test_transport", "test_units", "test_webrtc_track", "test_engine_core",
                "test_truncation", "test_access_units", "test_api_units", "test_prefix_cache", "test_memory_plan",
                "test_prompt", "test_report_stats", "test_realtime_transcription", "test_grammar",
                "test_vocoder_parity", "test_first_packet", "test_pacing", "test_snake_conv", "test_async_scheduling"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)


HANG_GUARD_S = 120.0  # how long a wait for a condition may take before the test calls it a hang


def wait_for(predicate, what: str, timeout_s: float = HANG_GUARD_S, poll_s: float = 0.1) -> None:
    """Poll until `predicate()`. The deadline guards against a hang only: it never bounds how fast the
    condition comes (a loaded 2-core machine may take long)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(poll_s)



def replica_pids(srv: ServerProcess) -> list[int]:
    """The worker processes `/health` lists. The engine core's stats reach the API process a little after it
    answers, so a test waits for the count it expects rather than reading the first answer."""
    return [r["pid"] for rs in srv.health()["replicas"].values() for r in rs if r.get("pid")]


async def until(predicate, what: str, timeout_s: float = HANG_GUARD_S, poll_s: float = 0.05) -> None:
    """`wait_for` for a test on an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(poll_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def reference_model():
    """The tiny checkpoint as plain transformers, for generate() parity (unchanged by any engine)."""
    from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model

    hf, _, _ = load_hf_model("tiny", "auto", torch.float32, torch.device("cpu"))
    return hf


@pytest.fixture(scope="session")
def tiny_config():
    from tests.profiles import load_profile

    return load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu")


@pytest.fixture(scope="session")
def engine(tiny_config):
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    eng = OmniEngine(tiny_config, load_models(tiny_config, get_platform("cpu")))
    eng.start()
    yield eng
    eng.stop()


def pinned(args: list[str]) -> list[str]:
    """What a test server runs with unless its test says otherwise: one API process, whatever the machine's cores
    (`--api-workers auto` would vary with the CI host), and no refusals for the front end's load (a busy CI
    machine would refuse sessions at random; tests/test_front_end_load.py sets the limits it tests)."""
    pins = [] if "--api-workers" in args else ["--api-workers", "1"]
    if not any(a.startswith("front_end.") for a in args):
        pins += ["--set", "front_end.max_loop_lag_ms=null", "--set", "front_end.max_vad_backlog_ms=null"]
    return pins


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, module: str = "omnirt.app.cli"):
        """`module`: the program serving (`python -m module serve ...`), `omnirt.app.cli` or a test's wrapper of it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = ARTIFACTS / f"server-{self.port}.log"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", module, "serve", "--port", str(self.port), "--threads", "1",
               "--log-level", "warning", *pinned(args), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()  # a server that never answered must not outlive the test
        raise RuntimeError(f"server did not start in 120 s: {self.log.read_text()[-2000:]}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=HANG_GUARD_S).json()

    def metric(self, name: str, **labels) -> float:
        """The sum of the /metrics samples of `name` whose labels include `labels`."""
        want = [f'{k}="{v}"' for k, v in labels.items()]
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name and all(w in head for w in want):
                total += float(value)
        return total

    def wait_idle(self, timeout: float = HANG_GUARD_S) -> dict:
        """Poll until every stage has all its slots free again (or the hang guard ends it); returns /health."""
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if h["free_slots"] == h["slots"] and h["active_requests"] == 0 or time.time() > deadline:
                return h
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


@pytest.fixture(scope="session")
def server():
    srv = ServerProcess([])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def utterance(tmp_path_factory):
    """An espeak-ng sentence (samples at 22.05 kHz, seconds of speech), made once for every test that speaks."""
    from tests.realtime_helpers import espeak_utterance

    return espeak_utterance(tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="session")
def speech(utterance):
    """The utterance's samples alone."""
    return utterance[0]
