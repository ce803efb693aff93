"""SIGTERM during active streams: the server stops admitting, lets a short response finish, ends a long
one at the deadline with an in-stream error that says why, and exits."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import ServerProcess
from tests.sse_client import audio_body, stream_chat


def test_sigterm_drains_then_closes_with_a_reason():
    srv = ServerProcess(["--shutdown-timeout", "4"])
    try:
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(stream_chat, srv.url, audio_body(max_tokens=12, frames=60))   # ~1 s of work
            long = pool.submit(stream_chat, srv.url, audio_body(max_tokens=60, frames=4000))  # minutes of work
            deadline = time.monotonic() + 30
            while srv.health()["active_requests"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            sent = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:  # no new work once draining: the listener is closed (or a 503 on a reused connection)
                r = httpx.post(f"{srv.url}/v1/chat/completions", json=audio_body(4, 8), timeout=5)
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
            except httpx.ConnectError:
                pass
            short, long = short.result(timeout=60), long.result(timeout=60)
        assert short.is_complete  # finished within the deadline, untouched
        assert long.status == 200 and not long.done and long.num_packets > 0
        assert long.error == {"message": "server shutting down", "type": "server_error", "param": None,
                              "code": "request_aborted"}
        assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert time.monotonic() - sent < 4 + 5 + 10  # deadline + uvicorn's grace + start-up slack
        assert "Traceback" not in srv.log.read_text()
    finally:
        srv.stop()
