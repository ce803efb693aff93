"""`--api-workers 2` against real servers: connections spread over both workers and all complete; the session,
per-key and per-minute limits hold over both; a client secret minted on one worker starts sessions on the
other; a WebRTC call is hung up through either; /metrics sums both (each worker's front-end load apart); a
killed worker gives back what it held and is replaced; a killed core ends every worker and the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
import websockets

from omnirt.loadtest.webrtc_client import connect
from tests.conftest import ServerProcess, wait_for
from tests.realtime_helpers import ask, key_subprotocols, recv, recv_type, until_done, ws_url

KEYS = {"plain": "sk-plain-0001", "pair": "sk-pair-0002", "rpm": "sk-rpm-0003"}
LIMITS = {"pair": {"max_sessions": 2}, "rpm": {"requests_per_minute": 3}}
MAX_SESSIONS = 6
LONG_ANSWER = {"max_output_tokens": 16, "talker_sampling": {"min_tokens": 300, "max_tokens": 300}}  # 24 s of audio


def start(args: list[str]) -> ServerProcess:
    srv = ServerProcess(["--api-workers", "2", *args])
    wait_for(lambda: all(w["pid"] for w in srv.health()["api_workers"]), "both workers serving")
    return srv


@pytest.fixture(scope="module")
def workers_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(json.dumps({"keys": [{"id": i, "key": k, **LIMITS.get(i, {})} for i, k in KEYS.items()]}))
    srv = start(["--api-keys-file", str(keys), "--realtime-max-sessions", str(MAX_SESSIONS), "--log-level", "info"])
    yield srv
    srv.stop()



def bearer(key_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key_id]}"}


def sessions_per_worker(srv: ServerProcess) -> list[int]:
    return [w["sessions"] for w in srv.health()["api_workers"]]


def client_on(srv: ServerProcess, worker: int) -> httpx.Client:
    """A keep-alive HTTP client whose connection the kernel gave to `worker` (new connections until one is)."""
    for _ in range(200):
        client = httpx.Client(base_url=srv.url, timeout=30)
        if client.get("/health").json()["api_worker"] == worker:
            return client
        client.close()
    raise AssertionError(f"no connection reached worker {worker}")


async def open_session(srv: ServerProcess, credential: str):
    ws = await websockets.connect(ws_url(srv), subprotocols=key_subprotocols(credential))
    assert (await recv(ws))["type"] == "session.created"
    return ws


async def refused(srv: ServerProcess, credential: str) -> dict:
    async with websockets.connect(ws_url(srv), subprotocols=key_subprotocols(credential)) as ws:
        err = await recv(ws)
        with pytest.raises(websockets.ConnectionClosed):
            await recv(ws)
    assert err["type"] == "error" and ws.close_code == 1013
    return err["error"]


async def sessions_on_both_workers(srv: ServerProcess, n: int, credential: str) -> list:
    """`n` open sessions, at least one in each worker (reopened until the kernel's spread gives that)."""
    for _ in range(10):
        opened = [await open_session(srv, credential) for _ in range(n)]
        if all(sessions_per_worker(srv)):
            return opened
        await asyncio.gather(*(ws.close() for ws in opened))
        wait_for(lambda: sum(sessions_per_worker(srv)) == 0, "the sessions closed")
    raise AssertionError("the sessions never spread over both workers")


async def test_connections_spread_over_both_workers_and_every_request_and_session_completes(workers_server):
    srv = workers_server
    served = {httpx.get(f"{srv.url}/health", timeout=10).json()["api_worker"] for _ in range(40)}
    assert served == {0, 1}
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=bearer("plain")) as http:
        chats = await asyncio.gather(*(http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4,
            "modalities": ["text"]}) for i in range(8)))
    assert [r.status_code for r in chats] == [200] * 8
    sessions = await sessions_on_both_workers(srv, MAX_SESSIONS, KEYS["plain"])
    try:
        for ws in sessions:
            await ask(ws, "Say something.", output_modalities=["text"], max_output_tokens=4)
        done = [(await until_done(ws))[-1] for ws in sessions]
        assert {d["response"]["status"] for d in done} <= {"completed", "incomplete"}
        assert len(done) == MAX_SESSIONS
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text  # summed over both workers
        assert f'omnirt_sessions_active{{transport="websocket"}} {MAX_SESSIONS}.0' in metrics
        assert 'process_cpu_seconds_total{worker="0"}' in metrics and 'worker="1"' in metrics
        for k in (0, 1):  # each worker's own front-end load, never a sum; on /health too, whichever worker answers
            assert f'omnirt_front_end_admitting{{worker="{k}"}} 1.0' in metrics
        rows = srv.health()["api_workers"]
        figures = {"loop_lag_ms", "vad_backlog_ms", "vad_waiting", "admitting"}
        assert [set(w["front_end"]) for w in rows] == [figures] * 2
    finally:
        await asyncio.gather(*(ws.close() for ws in sessions))
    wait_for(lambda: srv.health()["active_requests"] == 0 and sum(sessions_per_worker(srv)) == 0, "all ended")


async def test_the_session_limits_hold_over_both_workers(workers_server):
    srv = workers_server
    pair = await sessions_on_both_workers(srv, 2, KEYS["pair"])  # the key's limit, one session in each worker
    try:
        for _ in range(6):  # wherever these land, the key has its 2
            assert (await refused(srv, KEYS["pair"]))["code"] == "rate_limit_exceeded"
        rest = [await open_session(srv, KEYS["plain"]) for _ in range(MAX_SESSIONS - 2)]
        try:
            for _ in range(6):  # the server's limit, over both workers
                assert (await refused(srv, KEYS["plain"]))["code"] == "session_limit_reached"
        finally:
            await asyncio.gather(*(ws.close() for ws in rest))
    finally:
        await asyncio.gather(*(ws.close() for ws in pair))
    wait_for(lambda: sum(sessions_per_worker(srv)) == 0, "the sessions closed")
    codes = [httpx.get(f"{srv.url}/v1/models", headers=bearer("rpm"), timeout=10).status_code for _ in range(8)]
    assert sorted(codes) == [200] * 3 + [429] * 5  # 3 per minute, over both workers


async def test_a_client_secret_minted_on_one_worker_starts_sessions_on_the_other(workers_server):
    srv = workers_server
    http = client_on(srv, 0)
    try:
        minted = http.post("/v1/realtime/client_secrets", headers=bearer("plain"), json={
            "session": {"type": "realtime", "instructions": "Be brief."}})
    finally:
        http.close()
    assert minted.status_code == 200, minted.text
    for _ in range(20):
        ws = await open_session(srv, minted.json()["value"])
        try:
            if sessions_per_worker(srv)[1]:  # it landed on the worker that did not mint it
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
                updated = await recv_type(ws, "session.updated")
                assert updated["session"]["instructions"] == "Be brief."  # the secret's settings
                return
        finally:
            await ws.close()
            wait_for(lambda: sum(sessions_per_worker(srv)) == 0, "the session closed")
    raise AssertionError("no session landed on worker 1")


async def test_a_webrtc_call_is_hung_up_through_either_worker(workers_server):
    srv = workers_server
    call = await connect(srv.url, headers=bearer("plain"))
    try:
        owner = sessions_per_worker(srv).index(1)
        http = client_on(srv, 1 - owner)
        try:
            other_key = http.post(f"{call.location}/hangup", headers=bearer("pair"))
            assert other_key.status_code == 404  # only the key that started it
            assert http.post(f"{call.location}/hangup", headers=bearer("plain")).status_code == 200
        finally:
            http.close()
        wait_for(lambda: sum(sessions_per_worker(srv)) == 0, "the call ended in its worker")
    finally:
        await call.close()


async def test_a_killed_worker_gives_back_what_it_held_and_is_replaced(workers_server):
    """Last of the module's server: a worker killed mid-response; then SIGTERM stops everything."""
    srv = workers_server
    sessions = await sessions_on_both_workers(srv, 4, KEYS["plain"])
    for ws in sessions:
        await ask(ws, "Tell me a long story.", **LONG_ANSWER)
    for ws in sessions:
        await recv_type(ws, "response.output_audio.delta")
    wait_for(lambda: srv.health()["active_requests"] == len(sessions), "the engine runs every worker's responses")
    victim = srv.health()["api_workers"][1]["pid"]
    os.kill(victim, signal.SIGKILL)
    ended = 0
    for ws in sessions:  # the killed worker's connections drop; the other's responses finish
        try:
            await until_done(ws)
        except websockets.ConnectionClosed:
            ended += 1
    assert 1 <= ended < len(sessions)
    await asyncio.gather(*(ws.close() for ws in sessions))
    wait_for(lambda: all(w["pid"] and w["pid"] != victim for w in srv.health()["api_workers"]), "a new worker 1")
    wait_for(lambda: srv.health()["active_requests"] == 0 and sum(sessions_per_worker(srv)) == 0,
             "its requests aborted and its sessions given back")
    full = await sessions_on_both_workers(srv, MAX_SESSIONS, KEYS["plain"])  # the whole limit again
    await asyncio.gather(*(ws.close() for ws in full))
    pids = [w["pid"] for w in srv.health()["api_workers"]]
    srv.stop()
    assert srv.proc.returncode == 0, srv.log.read_text()[-2000:]
    assert not [p for p in pids if _alive(p)]
    assert "exited with code -9; its connections are gone; starting another" in srv.log.read_text()


async def test_a_killed_core_ends_every_worker_and_the_server():
    srv = start(["--log-level", "info"])
    try:
        workers = [w["pid"] for w in srv.health()["api_workers"]]
        core = next(p for p in _children(srv.proc.pid) if p not in workers and "resource_tracker" not in _cmdline(p))
        sessions = await sessions_on_both_workers(srv, 2, "unused")
        os.kill(core, signal.SIGKILL)
        for ws in sessions:
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await recv(ws, 30)
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1
        assert not [p for p in workers if _alive(p)]
        assert "the engine core process exited with code -9; the API workers stop" in srv.log.read_text()
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
