"""API keys (HTTP and WebSocket handshakes), CORS closed by default, body and audio limits, the loopback
default, /metrics and structured request logs (chat requests and Realtime sessions)."""

from __future__ import annotations

import base64
import json
import re
import time

import httpx
import numpy as np
import openai
import pytest
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from omnirt.app.audio.pcm import encode_wav
from omnirt.app.cli import build_parser
from omnirt.app.errors import APIError
from omnirt.app.ops.keys import KeyRing
from omnirt.app.ops.secret_store import SecretStore
from omnirt.app.ops.security import AccessCheck, authenticate
from omnirt.loadtest.server_metrics import steps
from tests.conftest import ServerProcess, until
from tests.realtime_helpers import ask, recv_type, ws_url

KEY = "sk-omnirt-test"
ORIGIN = "http://allowed.example"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def secure_server():
    srv = ServerProcess(["--api-key", KEY, "--cors-origins", ORIGIN, "--max-audio-seconds", "2",
                         "--max-body-bytes", "2000000", "--log-level", "info", "--log-format", "json"])
    yield srv
    srv.stop()


def test_binds_loopback_by_default():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_api_key_required_on_http(secure_server):
    url = f"{secure_server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error" and KEY not in r.text
    assert httpx.get(f"{secure_server.url}/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secure_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{secure_server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3).choices[0].message.content
    assert httpx.get(f"{secure_server.url}/health", timeout=10).status_code == 200  # probes stay open


def test_api_key_refuses_websocket_handshake(secure_server):
    import websocket  # websocket-client, a real WebSocket client

    ws_url = secure_server.url.replace("http", "ws") + "/v1/realtime"
    with pytest.raises(websocket.WebSocketBadStatusException) as exc:
        websocket.create_connection(ws_url, timeout=10)
    assert exc.value.status_code == 403


async def _echo(ws):
    await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", []) else None)
    await ws.send_text("ok")
    await ws.close()


@pytest.mark.parametrize("how", ["header", "subprotocol", "none", "wrong"])
def test_api_key_helper_on_websocket_routes(how):
    """The shared middleware on a WebSocket route: Bearer header, or OpenAI's browser subprotocol."""
    app = AccessCheck(Starlette(routes=[WebSocketRoute("/v1/realtime", _echo)]), KeyRing((KEY,)), SecretStore())
    kw = {"header": {"headers": {"Authorization": f"Bearer {KEY}"}},
          "subprotocol": {"subprotocols": ["realtime", f"openai-insecure-api-key.{KEY}"]},
          "none": {}, "wrong": {"headers": {"Authorization": "Bearer nope"}}}[how]
    with TestClient(app) as client:
        if how in ("header", "subprotocol"):
            with client.websocket_connect("/v1/realtime", **kw) as ws:
                assert ws.receive_text() == "ok"
        else:
            with pytest.raises(WebSocketDisconnect) as exc, client.websocket_connect("/v1/realtime", **kw):
                pass
            assert exc.value.code == 1008


def test_authenticate_scope_rules():
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    keys, store = KeyRing((KEY,)), SecretStore()
    assert authenticate(scope, keys, store).key_id == "cli-1"
    assert authenticate({**scope, "headers": []}, KeyRing(), store).key is None  # no keys: open
    with pytest.raises(APIError) as exc:
        authenticate({**scope, "headers": []}, keys, store)
    assert exc.value.status == 401
    assert authenticate({"type": "http", "path": "/health", "headers": []}, keys, store).key is None


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_closed_by_default_and_opt_in(server, secure_server):
    assert "access-control-allow-origin" not in _preflight(server.url, ORIGIN).headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert _preflight(secure_server.url, ORIGIN).headers.get("access-control-allow-origin") == ORIGIN
    assert "access-control-allow-origin" not in _preflight(secure_server.url, "http://evil.example").headers


def test_chunked_body_over_limit_is_413(secure_server):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 100_000
        yield b'"}]}'

    r = httpx.post(f"{secure_server.url}/v1/chat/completions", content=chunks(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_audio_duration_limit(secure_server):
    wav = encode_wav((np.zeros(24000 * 3)).astype("<i2").tobytes(), 24000)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    r = httpx.post(f"{secure_server.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "audio_too_long"


def _first_output_counts(url: str) -> list[float]:
    """Requests timed per stage (Thinker, Talker, Code2Wav), once the engine core's stats snapshot (sent every
    0.2 s) has the last request's Code2Wav output: read again until it has, never against a clock."""
    for _ in range(200):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        counts = [re.search(rf'omnirt_stage_first_output_seconds_count\{{stage="{stage}"\}} (\S+)', text)
                  for stage in ("thinker", "talker", "code2wav")]
        if all(counts) and float(counts[2].group(1)) >= 1:
            break
        time.sleep(0.05)
    return [float(c.group(1)) if c else 0.0 for c in counts]


def test_metrics_and_structured_request_logs(secure_server):
    r = httpx.post(f"{secure_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": "tiny", "messages": MSG, "max_tokens": 8, "modalities": ["text", "audio"],
                         "audio": {"voice": "ethan", "format": "wav"}})
    rid = r.json()["id"]
    assert httpx.get(f"{secure_server.url}/v1/models", timeout=10).status_code == 401  # counted by type below
    firsts = _first_output_counts(secure_server.url)  # waits for the engine snapshot that has the request
    text = httpx.get(f"{secure_server.url}/metrics", timeout=10).text
    for name in ("omnirt_requests_total", "omnirt_requests_active", "omnirt_stage_queue_depth",
                 "omnirt_stage_batch_size_bucket", "omnirt_audio_ttfp_seconds_bucket", "omnirt_audio_rtf_bucket",
                 "omnirt_audio_underruns_total", "omnirt_errors_total", "omnirt_sessions_active"):
        assert name in text, name
    assert 'omnirt_errors_total{type="authentication_error"}' in text
    step_s = re.search(r'omnirt_stage_step_seconds_total\{part="host",stage="thinker"\} (\S+)', text)
    assert step_s and float(step_s.group(1)) > 0  # the request's steps were timed
    thinker = steps(text.splitlines())["thinker"]  # one prefill step of the prompt, a decode step a token after it
    assert thinker["prefill_steps"] >= 1 and thinker["decode_steps"] >= 1 and thinker["decode_s"] > 0, thinker
    for stage in ("thinker", "talker", "code2wav"):  # the request took its first step in each stage
        first = re.search(rf'omnirt_stage_first_step_wait_steps_count\{{stage="{stage}"\}} (\S+)', text)
        assert first and float(first.group(1)) >= 1, stage
        assert f'omnirt_stage_max_wait_steps{{stage="{stage}"}}' in text
        assert f'omnirt_stage_deferred_rows_total{{stage="{stage}"}}' in text
    placement = r'omnirt_stage_placements_total\{how="(\w+)",stage="thinker"\} (\S+)'
    placed = {how: float(n) for how, n in re.findall(placement, text)}
    assert set(placed) == {"fresh", "taken_over", "copied", "restored"} and sum(placed.values()) >= 1, placed
    assert 'omnirt_stage_given_up_slots_total{stage="thinker"}' in text
    assert firsts[0] >= firsts[1] >= firsts[2] >= 1  # each stage's first output timed, audio ones downstream too
    lines = [json.loads(line) for line in secure_server.log.read_text().splitlines() if line.startswith("{")]
    done = [rec for rec in lines if rec.get("request_id") == rid]
    assert done and done[-1]["msg"] == "request finished" and done[-1]["ttfp_ms"] > 0 and done[-1]["rtf"] > 0


async def test_realtime_sessions_in_metrics_and_logs(secure_server):
    """A WebSocket session counts in omnirt_sessions_active while open and in omnirt_sessions_total once
    closed; its log lines, and its response's "request finished" line, carry the session id."""
    srv = secure_server
    closed_before = srv.metric("omnirt_sessions_total", transport="websocket", state="closed")
    async with websockets.connect(ws_url(srv), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        session_id = (await recv_type(ws, "session.created"))["session"]["id"]
        assert srv.metric("omnirt_sessions_active", transport="websocket") == 1
        await ask(ws, "Hi", max_output_tokens=3, talker_sampling={"max_tokens": 12})
        response_id = (await recv_type(ws, "response.done"))["response"]["id"]
    await until(lambda: srv.metric("omnirt_sessions_active", transport="websocket") == 0, "the session closed")
    assert srv.metric("omnirt_sessions_total", transport="websocket", state="closed") == closed_before + 1
    assert srv.metric("omnirt_requests_total", endpoint="realtime") >= 1
    lines = [json.loads(line) for line in srv.log.read_text().splitlines() if line.startswith("{")]
    mine = [rec for rec in lines if rec.get("session_id") == session_id]
    assert [rec["msg"] for rec in mine if rec["msg"].startswith("realtime session")] == [
        "realtime session open (model tiny, beta False)", "realtime session closed (closed)"]
    done = [rec for rec in mine if rec["msg"] == "request finished"]
    assert len(done) == 1 and done[0]["request_id"] == response_id and done[0]["ttfp_ms"] > 0


async def test_cross_origin_pages_are_refused_on_websocket_and_signalling(server, secure_server):
    """CORS does not cover WebSocket upgrades or a page's form/text posts: the origin check does. Same-origin
    pages, --cors-origins and clients without `Origin` pass; any other origin gets 403 and a log line."""
    own = f"http://127.0.0.1:{server.port}"
    with pytest.raises(websockets.InvalidStatus) as exc:
        await websockets.connect(ws_url(server), origin="http://evil.example")
    assert exc.value.response.status_code == 403
    for origin in (own, None):
        async with websockets.connect(ws_url(server), origin=origin) as ws:
            await recv_type(ws, "session.created")
    sdp = {"Content-Type": "application/sdp", "Origin": "http://evil.example"}
    for path, headers, body in (("/v1/realtime/calls", sdp, b"v=0\r\n"), ("/v1/realtime?model=tiny", sdp, b"v=0\r\n"),
                                ("/v1/chat/completions", {"Content-Type": "text/plain", "Origin": "null"}, b"{}")):
        r = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", path
    r = httpx.post(f"{server.url}/v1/realtime/calls", content=b"v=0\r\n", timeout=10,
                   headers={**sdp, "Origin": own})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sdp"  # same origin: on to the route
    assert httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://evil.example"}).status_code == 200  # a read
    assert "refused WebSocket /v1/realtime from origin 'http://evil.example'" in server.log.read_text()
    bearer = {"Authorization": f"Bearer {KEY}"}
    async with websockets.connect(ws_url(secure_server), origin=ORIGIN, additional_headers=bearer) as ws:
        await recv_type(ws, "session.created")  # listed in --cors-origins
    with pytest.raises(websockets.InvalidStatus) as exc:  # a valid key does not let another origin in
        await websockets.connect(ws_url(secure_server), origin="http://evil.example", additional_headers=bearer)
    assert exc.value.response.status_code == 403
