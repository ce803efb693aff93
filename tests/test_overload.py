"""Overload (chat 429s, Realtime connect refusals), slow readers and disconnect storms against a real
server with small stages (2 slots + 2 waiting per stage), a 2 s slow-client timeout and a 256 KiB
output buffer per request."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import websockets

from tests.conftest import ServerProcess, until, wait_for
from tests.realtime_helpers import ask, lost_audio, recv, recv_type, until_done, ws_url
from tests.sse_client import audio_body, stream_chat

SMALL = json.dumps({str(i): {"max_num_seqs": 2, "max_waiting": 2} for i in range(3)})


@pytest.fixture(scope="module")
def small_server():
    srv = ServerProcess(["--stage-overrides", SMALL, "--slow-client-timeout", "2",
                         "--max-output-buffer-bytes", str(256 * 1024)])
    yield srv
    srv.stop()


def test_overload_gets_429_and_admitted_complete_whole(small_server):
    """A full server refuses a flood with 429 and the requests it admitted stream on, whole. Their first-packet
    latency, alone and flooded, is printed (a figure, not a bound: a loaded machine moves it)."""
    url, body = small_server.url, audio_body(max_tokens=16, frames=40)
    long_body = audio_body(max_tokens=16, frames=400)  # still running while the flood comes, however slow
    with ThreadPoolExecutor(4) as pool:  # baseline: the server full (4 admitted), nobody refused
        base = list(pool.map(lambda _: stream_chat(url, body), range(4)))
    assert all(r.is_complete for r in base)
    rejected_before = small_server.metric("omnirt_requests_total", endpoint="chat", state="rejected")
    with ThreadPoolExecutor(16) as pool:  # 4 fit, then a flood of 60 more while they run
        admitted = [pool.submit(stream_chat, url, long_body) for _ in range(4)]
        wait_for(lambda: small_server.health()["active_requests"] == 4, "the 4 admitted", poll_s=0.05)
        flood = list(pool.map(lambda _: stream_chat(url, body), range(60)))
        admitted = [f.result() for f in admitted]
    refused = [r for r in flood if r.status == 429]
    assert len(refused) >= 40, [r.status for r in flood]
    assert all(r.status == 200 and r.is_complete for r in flood if r.status != 429)
    for r in refused:
        err = json.loads(r.body)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
    assert all(r.is_complete for r in admitted)
    base_ttfp = statistics.median(r.ttfp_s for r in base)
    over_ttfp = statistics.median(r.ttfp_s for r in admitted)
    print(f"overload: {len(refused)}/{len(flood)} refused; TTFP p50 {base_ttfp:.3f} s alone, {over_ttfp:.3f} s flooded")
    rejected = small_server.metric("omnirt_requests_total", endpoint="chat", state="rejected")
    assert rejected - rejected_before == len(refused)
    assert small_server.metric("omnirt_http_responses_total", code="429") >= len(refused)
    h = small_server.wait_idle()
    assert h["free_slots"] == h["slots"]


def _slow_reader(url: str, body: dict) -> tuple[socket.socket, int]:
    """A raw HTTP client with an 8 KiB receive buffer that sends the request and then reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock, len(data)


def test_slow_reader_is_disconnected_without_slowing_others(small_server):
    url = small_server.url
    sock, _ = _slow_reader(url, audio_body(max_tokens=60, frames=1500))  # ~120 s of audio, ~7.7 MB of SSE
    time.sleep(1.0)
    normal = stream_chat(url, audio_body(max_tokens=16, frames=40))
    assert normal.is_complete  # served whole while the unread response still holds its slots
    h = small_server.wait_idle()  # the unread request was aborted, its slots freed
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
    sock.settimeout(120)  # a guard against a hang only
    received = 0
    while chunk := sock.recv(1 << 16):  # what the kernel buffered, then EOF: the server hung up
        received += len(chunk)
    sock.close()
    assert received < 6 * 2**20  # the whole response is ~7.7 MB
    assert small_server.metric("omnirt_requests_total", endpoint="chat", state="abort") >= 1


def test_http_disconnect_storm_frees_every_slot(small_server):
    """Hundreds of streaming clients hang up at random points (before the headers, mid text, mid audio)."""
    url, rng, lock = small_server.url, random.Random(1), threading.Lock()

    def one(i: int) -> None:
        with lock:
            cut = rng.choice([0, 1, 3, 8])
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=audio_body(16, 60), timeout=5) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= cut:
                        break
        except httpx.HTTPError:
            pass

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(400)))
    h = small_server.wait_idle()
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
    assert stream_chat(url, audio_body(8, 20)).is_complete  # and it still serves


async def test_realtime_connect_refused_when_full_and_running_sessions_go_on(small_server):
    """4 sessions each run a response (every stage full: 2 slots + 2 waiting); a 5th connect is refused
    with 1013 and a reason, counted in /metrics; the 4 responses stream on, whole; then it connects."""
    srv = small_server
    refused_before = srv.metric("omnirt_sessions_total", transport="websocket", state="refused")
    sessions = [await websockets.connect(ws_url(srv), max_size=None) for _ in range(4)]
    try:
        for ws in sessions:
            await recv_type(ws, "session.created")
            await ask(ws, "Tell me a story.", max_output_tokens=4, talker_sampling={"min_tokens": 40, "max_tokens": 40})
        await until(lambda: srv.health()["active_requests"] == 4, "the 4 responses admitted")
        async with websockets.connect(ws_url(srv)) as late:
            err = await recv(late)
            assert err["type"] == "error" and err["error"]["code"] == "server_busy"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await recv(late)
        assert closed.value.rcvd.code == 1013 and "capacity" in closed.value.rcvd.reason, closed.value.rcvd
        assert srv.metric("omnirt_sessions_total", transport="websocket", state="refused") == refused_before + 1
        assert srv.metric("omnirt_sessions_active", transport="websocket") == 4
        for ws in sessions:
            events = await until_done(ws)
            done = events[-1]["response"]
            assert done["status"] in ("completed", "incomplete"), done["status_details"]
            assert lost_audio(events, done["id"]) is None, lost_audio(events, done["id"])
    finally:
        for ws in sessions:
            await ws.close()
    async with websockets.connect(ws_url(srv)) as again:  # room again: the refused client retries
        await recv_type(again, "session.created")
    h = srv.wait_idle()
    assert h["free_slots"] == h["slots"]


async def test_realtime_disconnect_storm_frees_every_slot(small_server):
    """Realtime clients vanish at random points (right after connecting, right after `response.create`,
    after the first or third audio delta), half with a close frame and half by dropping the TCP
    connection: every slot comes back, no session stays open, and a new session gets a whole answer."""
    srv, rng = small_server, random.Random(2)
    plans = [(rng.choice([0, 1, 2, 4]), rng.random() < 0.5) for _ in range(120)]
    limit, cuts = asyncio.Semaphore(4), collections.Counter()

    async def one(num_deltas: int, abrupt: bool) -> None:
        async with limit:
            ws = await websockets.connect(ws_url(srv), max_size=None)
            try:
                if (await recv(ws))["type"] == "session.created" and num_deltas:
                    await ask(ws, "Tell me a story.", max_output_tokens=8, talker_sampling={"min_tokens": 40,
                                                                                            "max_tokens": 40})
                    seen = 0
                    while seen < num_deltas - 1 and (ev := await recv(ws))["type"] != "response.done":
                        seen += ev["type"] == "response.output_audio.delta"
                    cuts["mid_audio" if seen else "before_audio"] += 1
            except websockets.ConnectionClosed:
                cuts["refused"] += 1  # at connect (1013) while the others hold every slot: allowed
            finally:
                if abrupt:
                    ws.transport.abort()  # no close frame: the TCP connection just ends
                else:
                    await ws.close()

    await asyncio.gather(*(one(*plan) for plan in plans))
    assert cuts["mid_audio"] >= 20, cuts
    print(f"realtime disconnect storm: {dict(cuts)}")
    h = await asyncio.to_thread(srv.wait_idle)
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
    await until(lambda: srv.metric("omnirt_sessions_active", transport="websocket") == 0, "every session closed")
    async with websockets.connect(ws_url(srv), max_size=None) as ws:
        await recv_type(ws, "session.created")
        await ask(ws, "Hello!", max_output_tokens=4, talker_sampling={"min_tokens": 20, "max_tokens": 20})
        events = await until_done(ws)
    assert lost_audio(events, events[-1]["response"]["id"]) is None
