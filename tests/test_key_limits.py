"""Per-key limits from a keys file, against a real server: requests per minute and requests in flight (HTTP
429 in OpenAI's shape, the SDK's RateLimitError, a Realtime `error` and close 1013), open sessions over
WebSocket, WebRTC and client secrets; the file reloaded on change and on SIGHUP (a broken one keeps the
keys in force, a removed key's secrets stop working); /metrics and the logs name key ids, never keys; a
bad file or demo key stops the server at start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
import websockets

from omnirt.loadtest.webrtc_client import connect
from tests.conftest import ROOT, ServerProcess, wait_for
from tests.realtime_helpers import key_subprotocols, mint_secret, recv, recv_type, ws_url

KEYS = {"backend": "sk-backend-0001", "rpm": "sk-rpm-0002", "busy": "sk-busy-0003", "sessions": "sk-sessions-0004",
        "doomed": "sk-doomed-0005"}
LIMITS = {"rpm": {"requests_per_minute": 2}, "busy": {"max_requests": 1}, "sessions": {"max_sessions": 1}}


def keys_yaml(keys: dict[str, str]) -> str:
    return json.dumps({"keys": [{"id": i, "key": k, **LIMITS.get(i, {})} for i, k in keys.items()]})


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(keys_yaml(KEYS))
    return path


@pytest.fixture(scope="module")
def limits_server(keys_file):
    srv = ServerProcess(["--api-keys-file", str(keys_file), "--log-level", "info", "--log-format", "json"])
    yield srv
    srv.stop()


def bearer(key_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key_id]}"}


def models(srv: ServerProcess, headers: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/models", headers=headers, timeout=30)



async def refused_session(url: str, **kw) -> dict:
    """A WebSocket session refused after accept: its `error` event, after which the server closes with 1013."""
    async with websockets.connect(url, **kw) as ws:
        err = await recv(ws)
        with pytest.raises(websockets.ConnectionClosed):
            await recv(ws)
        assert ws.close_code == 1013, ws.close_reason
    assert err["type"] == "error"
    return err["error"]


async def test_requests_per_minute(limits_server):
    srv = limits_server
    assert [models(srv, bearer("rpm")).status_code for _ in range(2)] == [200, 200]  # 2 per minute, at once
    r = models(srv, bearer("rpm"))
    err = r.json()["error"]
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 30
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error" and "'rpm'" in err["message"]
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEYS["rpm"], max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.models.list()
    err = await refused_session(ws_url(srv), subprotocols=key_subprotocols(KEYS["rpm"]))  # a session start counts
    assert err["code"] == "rate_limit_exceeded" and "requests per min" in err["message"]
    assert models(srv, bearer("backend")).status_code == 200  # another key's budget is its own
    assert srv.metric("omnirt_key_limited_total", key="rpm", limit="requests_per_minute") == 3


def held_request(srv: ServerProcess, key: str) -> socket.socket:
    """A chat request whose body never finishes arriving: in flight until the socket closes."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nAuthorization: Bearer {key}"
                 f"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"model\":".encode())
    return sock


def test_requests_in_flight(limits_server):
    srv = limits_server
    sock = held_request(srv, KEYS["busy"])
    try:
        wait_for(lambda: srv.metric("omnirt_key_active", key="busy", kind="requests") == 1, "the request in flight")
        r = models(srv, bearer("busy"))
        assert r.status_code == 429 and "max_requests" in r.json()["error"]["message"]
        assert models(srv, bearer("backend")).status_code == 200
    finally:
        sock.close()
    wait_for(lambda: srv.metric("omnirt_key_active", key="busy", kind="requests") == 0, "the request's end")
    assert models(srv, bearer("busy")).status_code == 200
    assert srv.metric("omnirt_key_limited_total", key="busy", limit="max_requests") == 1


async def test_open_sessions_over_every_transport(limits_server):
    srv = limits_server
    secret = mint_secret(srv, KEYS["sessions"])["value"]  # its sessions count against the key that minted it
    async with websockets.connect(ws_url(srv), additional_headers=bearer("sessions")) as ws:
        await recv_type(ws, "session.created")
        assert srv.metric("omnirt_key_active", key="sessions", kind="sessions") == 1
        err = await refused_session(ws_url(srv), additional_headers=bearer("sessions"))
        assert err["code"] == "rate_limit_exceeded" and "max_sessions" in err["message"]
        err = await refused_session(ws_url(srv), subprotocols=key_subprotocols(secret))
        assert err["code"] == "rate_limit_exceeded"
        r = httpx.post(f"{srv.url}/v1/realtime/calls", content=b"v=0\r\n", timeout=30,
                       headers={**bearer("sessions"), "Content-Type": "application/sdp"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        async with websockets.connect(ws_url(srv), additional_headers=bearer("backend")) as other:
            await recv_type(other, "session.created")  # other keys open sessions as usual
    wait_for(lambda: srv.metric("omnirt_key_active", key="sessions", kind="sessions") == 0, "the session's end")
    call = await connect(srv.url, headers={"Authorization": f"Bearer {secret}"})  # room again: a WebRTC call
    try:
        await call.wait_for(lambda ev: ev["type"] == "session.created", 30)
        assert srv.metric("omnirt_key_active", key="sessions", kind="sessions") == 1
        hangup = f"{srv.url}{call.location}/hangup"
        assert httpx.post(hangup, headers=bearer("backend"), timeout=10).status_code == 404  # not its call
        assert httpx.post(hangup, headers=bearer("sessions"), timeout=10).status_code == 200  # its secret's key's
    finally:
        await call.close()
    assert srv.metric("omnirt_key_limited_total", key="sessions", limit="max_sessions") == 3
    assert srv.metric("omnirt_sessions_total", transport="webrtc", state="refused") >= 1


def rewrite(path, text: str, keep_stamp: bool = False) -> None:
    """Write the keys file in place; `keep_stamp`: with the same size and mtime (only SIGHUP can tell)."""
    st = os.stat(path)
    if keep_stamp:
        assert len(text) == st.st_size
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns if keep_stamp else st.st_mtime_ns + 10**9))


async def test_the_keys_file_reloads_without_a_restart(limits_server, keys_file):
    srv = limits_server
    secret = mint_secret(srv, KEYS["doomed"])["value"]
    rewrite(keys_file, keys_yaml({**{k: v for k, v in KEYS.items() if k != "doomed"}, "late": "sk-late-0006"}))
    assert models(srv, {"Authorization": "Bearer sk-late-0006"}).status_code == 200  # seen at the next request
    assert models(srv, bearer("doomed")).status_code == 401
    with pytest.raises(websockets.InvalidStatus) as exc:  # the removed key's secrets went with it
        await websockets.connect(ws_url(srv), subprotocols=key_subprotocols(secret))
    assert exc.value.response.status_code == 403
    same_size = keys_yaml({**{k: v for k, v in KEYS.items() if k != "doomed"}, "lat2": "sk-lat2-0006"})
    rewrite(keys_file, same_size, keep_stamp=True)
    assert models(srv, {"Authorization": "Bearer sk-lat2-0006"}).status_code == 401  # unchanged stamp: not re-read
    os.kill(srv.proc.pid, signal.SIGHUP)
    wait_for(lambda: models(srv, {"Authorization": "Bearer sk-lat2-0006"}).status_code == 200, "the SIGHUP reload")
    rewrite(keys_file, "keys: [{id: broken")
    assert models(srv, {"Authorization": "Bearer sk-lat2-0006"}).status_code == 200  # the keys in force stay
    assert srv.proc.poll() is None
    rewrite(keys_file, keys_yaml(KEYS))
    assert models(srv, bearer("doomed")).status_code == 200
    lines = [json.loads(line) for line in srv.log.read_text().splitlines() if line.startswith("{")]
    assert [rec for rec in lines if rec["msg"].startswith("keys file not reloaded") and rec["level"] == "error"]


def test_metrics_and_logs_name_key_ids_never_keys(limits_server):
    srv = limits_server
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert 'omnirt_key_requests_total{key="backend"}' in text and 'omnirt_key_limited_total{key="rpm"' in text
    log = srv.log.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(rec.get("key_id") == "rpm" and "requests_per_minute" in rec["msg"] for rec in lines)
    assert any(rec.get("key_id") == "sessions" and rec["msg"].startswith("realtime session open") for rec in lines)
    for key in KEYS.values():
        assert key not in text and key not in log


@pytest.mark.parametrize("args, error", [
    (["--api-keys-file", "{bad}"], "keys[0].max_session is not a known field"),
    (["--api-keys-file", "{missing}"], "cannot be read"),
    (["--api-key", "sk-one-12345", "--demo-key-id", "nobody"], "--demo-key-id 'nobody' is not the id of a key"),
])
def test_a_bad_keys_file_or_demo_key_stops_the_server_at_start(tmp_path, args, error):
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: [{id: a, key: sk-123456789, max_session: 2}]")
    args = [a.format(bad=bad, missing=tmp_path / "missing.yaml") for a in args]
    done = subprocess.run([sys.executable, "-m", "omnirt.app.cli", "serve", "--port", "0", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and error in done.stderr, done.stderr[-2000:]
