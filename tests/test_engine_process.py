"""`omnirt serve` with the engine core in a process of its own: a stop or a crash of either process leaves
no process, socket or shared-memory segment behind, and a core that dies mid-stream ends the streams with
an error and stops the server with a non-zero exit, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import websockets

from tests.conftest import ServerProcess, replica_pids, until, wait_for
from tests.realtime_helpers import ask, recv, recv_type, ws_url
from tests.sse_client import audio_body, stream_chat

pytestmark = pytest.mark.timeout(300)
SHM = Path("/dev/shm")


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def core_of(srv: ServerProcess) -> psutil.Process:
    (core,) = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    return core


def wait_gone(procs: list[psutil.Process], timeout_s: float = 120.0) -> list[psutil.Process]:
    """The processes still alive after `timeout_s` (a liveness wait, not a latency bound)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


def rings_of(procs: list[psutil.Process]) -> set[str]:
    """The shared-memory rings these processes map: this server's own, whatever other runs on the machine
    create in /dev/shm meanwhile."""
    names = set()
    for p in procs:
        with contextlib.suppress(psutil.Error):
            names |= {Path(m.path).name for m in p.memory_maps() if m.path.startswith(f"{SHM}/psm_")}
    return names


def wait_unlinked(rings: set[str]) -> None:
    """Until none of `rings` is left in /dev/shm (the last process to close one may unlink it a little later)."""
    wait_for(lambda: not rings & set(os.listdir(SHM)), f"the rings unlinked: {rings & set(os.listdir(SHM))}")


def server(tmp_path: Path, *args: str) -> ServerProcess:
    """A server whose temporary files (the core's IPC sockets) go to `tmp_path`."""
    return ServerProcess(list(args), env={"TMPDIR": str(tmp_path)})


def test_sigterm_stops_every_process_of_a_replicated_server(tmp_path):
    """API process, engine core and five replica workers: SIGTERM ends them all, sockets and rings gone."""
    srv = server(tmp_path, "--deploy-config", "qwen3_omni_moe_multi_replicas",
                 "--stage-overrides", json.dumps({"1": {"num_replicas": 2}}))
    try:
        wait_for(lambda: len(replica_pids(srv)) == 4, "the four replica workers listed")
        procs = descendants(srv.proc.pid)
        assert set(replica_pids(srv)) <= {p.pid for p in procs}
        assert len(list(tmp_path.glob("omnirt-core-*"))) == 1
        assert stream_chat(srv.url, audio_body(8, frames=12)).is_complete
        rings = rings_of([psutil.Process(srv.proc.pid), *procs])
        assert rings  # the workers' rings: what must be gone afterwards
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert wait_gone(procs) == []
        assert list(tmp_path.glob("omnirt-core-*")) == []  # the IPC sockets are gone
        wait_unlinked(rings)
    finally:
        srv.stop()


def test_killed_api_process_takes_the_core_with_it(tmp_path):
    srv = server(tmp_path)
    try:
        procs = descendants(srv.proc.pid)
        assert procs
        srv.proc.kill()
        srv.proc.wait(timeout=60)
        assert wait_gone(procs) == []  # the core notices its parent is gone and stops
    finally:
        srv.stop()


def test_core_killed_mid_stream_ends_streams_and_stops_the_server(tmp_path):
    """Each request either started streaming (200, then an in-stream error and no [DONE]) or had not
    yet been taken by the core when it died (a 503): both name the dead engine."""
    srv = server(tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream_chat, srv.url, audio_body(60, frames=4000)) for _ in range(2)]
            wait_for(lambda: srv.health()["active_requests"] == 2, "both requests running", poll_s=0.05)
            core_of(srv).kill()
            results = [s.result(timeout=60) for s in streams]
        for r in results:
            assert (r.status == 200 and not r.done) or r.status == 503
            assert r.error["type"] == "server_error" and "engine core process exited" in r.error["message"]
        assert srv.proc.wait(timeout=60) not in (0, -signal.SIGTERM)  # a dead engine is a failed server
        log = srv.log.read_text()
        assert "the engine is gone" in log and "Traceback" not in log
        assert list(tmp_path.glob("omnirt-core-*")) == []  # the IPC sockets are gone
    finally:
        srv.stop()


async def test_core_killed_with_workers_and_a_realtime_session(tmp_path):
    """kill -9 of the core of a replicated server: the Realtime response fails naming the engine, the session
    gets an `error` event and a close, the workers (the core's children) stop by themselves, the server exits
    non-zero, and no IPC socket or shared-memory ring is left."""
    srv = server(tmp_path, "--deploy-config", "qwen3_omni_moe_multi_replicas")
    try:
        await until(lambda: len(replica_pids(srv)) == 4, "the four replica workers listed")
        procs = descendants(srv.proc.pid)
        ws = await websockets.connect(ws_url(srv), max_size=None)
        await recv_type(ws, "session.created")
        await ask(ws, "Hello!", max_output_tokens=40, talker_sampling={"min_tokens": 4000, "max_tokens": 4000})
        await recv_type(ws, "response.output_audio.delta", timeout=120)
        rings = rings_of([psutil.Process(srv.proc.pid), *procs])
        assert rings
        core_of(srv).kill()
        events = []
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                events.append(await recv(ws, timeout=60))
        done = next(e["response"] for e in events if e["type"] == "response.done")
        assert done["status"] == "failed" and "engine core" in done["status_details"]["error"]["message"]
        assert events[-1]["type"] == "error"
        assert await asyncio.to_thread(srv.proc.wait, 60) not in (0, -signal.SIGTERM)
        assert await asyncio.to_thread(wait_gone, procs) == []
        assert list(tmp_path.glob("omnirt-core-*")) == []
        await asyncio.to_thread(wait_unlinked, rings)
    finally:
        srv.stop()
