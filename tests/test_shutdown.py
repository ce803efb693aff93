"""SIGTERM during active streams and Realtime sessions: the server stops admitting, lets a short response
finish, ends a long one at the deadline with an in-stream error that says why, closes Realtime sessions
with 1001 and that reason, and exits."""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import websockets
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from omnirt.app.ops.lifecycle import SHUTDOWN_REASON
from omnirt.app.server import create_app
from omnirt.app.state import ServerSettings, app_state
from tests.conftest import HANG_GUARD_S, ServerProcess, until, wait_for
from tests.realtime_helpers import ask, lost_audio, recv, recv_type, ws_url
from tests.sse_client import audio_body, stream_chat

# The drain's deadline: far above what the short responses need even on a loaded machine (about 1 s of work
# each), far below the long ones (minutes of work), so that which one is cut never depends on the load.
DRAIN_S = 15


def test_sigterm_drains_then_closes_with_a_reason():
    srv = ServerProcess(["--shutdown-timeout", str(DRAIN_S), "--log-level", "info"])
    try:
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(stream_chat, srv.url, audio_body(max_tokens=12, frames=60))   # ~1 s of work
            long = pool.submit(stream_chat, srv.url, audio_body(max_tokens=60, frames=4000))  # minutes of work
            wait_for(lambda: srv.health()["active_requests"] == 2, "both requests running", poll_s=0.05)
            srv.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining:" in srv.log.read_text(), "the drain to begin")
            try:  # no new work once draining: the listener is closed (a connection still in its backlog is reset),
                # or a 503 on a reused connection
                r = httpx.post(f"{srv.url}/v1/chat/completions", json=audio_body(4, 8), timeout=HANG_GUARD_S)
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                pass
            short, long = short.result(timeout=60), long.result(timeout=60)
        assert short.is_complete  # finished within the deadline, untouched
        assert long.status == 200 and not long.done and long.num_packets > 0
        assert long.error == {"message": "server shutting down", "type": "server_error", "param": None,
                              "code": "request_aborted"}
        assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()


async def _until_closed(ws) -> tuple[list[dict], float]:
    """Every event up to the close, and when the close came."""
    events = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            events.append(await recv(ws, timeout=60))
    return events, time.monotonic()


async def test_sigterm_closes_realtime_sessions_with_a_reason_after_the_drain():
    """A short response finishes whole; a long one is ended at the drain's deadline (`failed`, "server shutting
    down"); then each session gets an `error` event and a close 1001 with the reason, and the server exits."""
    srv = ServerProcess(["--shutdown-timeout", str(DRAIN_S), "--log-level", "info"])
    try:
        short, long = [await websockets.connect(ws_url(srv), max_size=None) for _ in range(2)]
        for ws, frames in ((short, 40), (long, 4000)):
            await recv_type(ws, "session.created")
            await ask(ws, "Hello!", max_output_tokens=4, talker_sampling={"min_tokens": frames, "max_tokens": frames})
        await until(lambda: srv.health()["active_requests"] == 2, "both responses running")
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        (short_events, short_at), (long_events, long_at) = await asyncio.gather(_until_closed(short),
                                                                                _until_closed(long))
        for ws, events, status in ((short, short_events, "completed"), (long, long_events, "failed")):
            done = next(e["response"] for e in events if e["type"] == "response.done")
            assert done["status"] in ((status, "incomplete") if status == "completed" else (status,)), done
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
            assert ws.close_code == 1001 and ws.close_reason == SHUTDOWN_REASON
        assert lost_audio(short_events, done_id(short_events)) is None
        assert next(e for e in long_events if e["type"] == "response.done")["response"]["status_details"][
            "error"]["message"] == SHUTDOWN_REASON
        # both open until the drain's end, not before (a lower bound: a loaded machine only adds to it)
        assert long_at - sent > DRAIN_S - 0.5 and short_at - sent > DRAIN_S - 0.5
        assert await asyncio.to_thread(srv.proc.wait, 30) in (0, -signal.SIGTERM)
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()


def done_id(events: list[dict]) -> str:
    return next(e["response"]["id"] for e in events if e["type"] == "response.done")


def test_realtime_connect_while_draining_is_refused_with_1001(engine):
    """In process: a session that connects while the server drains gets an `error` event and 1001, counted."""
    app = create_app(engine, ServerSettings())
    app_state(app).lifecycle.is_draining = True
    with TestClient(app) as client, client.websocket_connect("ws://localhost/v1/realtime") as ws:
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["code"] == "server_shutting_down"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert closed.value.code == 1001 and closed.value.reason == SHUTDOWN_REASON
    text = app_state(app).metrics.render().decode()
    assert 'omnirt_sessions_total{state="refused",transport="websocket"} 1.0' in text
