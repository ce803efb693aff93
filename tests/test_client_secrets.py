"""Ephemeral client secrets against a real server with an API key: minted with the openai SDK (GA and beta),
used on the WebSocket (Bearer header, the browser's subprotocol) and on a WebRTC call, each session
starting with the secret's settings; a secret starts sessions and does nothing else; it expires; minting
needs a real key; and on a server without keys, secrets still carry their settings."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import websockets

from omnirt.loadtest.webrtc_client import connect
from tests.conftest import ServerProcess
from tests.realtime_helpers import ask, key_subprotocols, mint_secret, recv, recv_type, until_done, ws_url

KEY = "sk-omnirt-secrets-test"
SESSION = {"type": "realtime", "instructions": "Answer in one word.", "output_modalities": ["text"],
           "audio": {"output": {"voice": "chelsie"}, "input": {"turn_detection": None}}}


@pytest.fixture(scope="module")
def keyed_server():
    srv = ServerProcess(["--api-key", KEY, "--log-level", "info", "--log-format", "json"])
    yield srv
    srv.stop()


def sdk(srv: ServerProcess, credential: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=credential, max_retries=0, timeout=60,
                              websocket_base_url=f"ws://127.0.0.1:{srv.port}/v1")


def assert_ga_settings(session: dict) -> None:
    """SESSION's settings, in a GA session object (`session.created` or the minted secret's)."""
    assert session["instructions"] == "Answer in one word." and session["output_modalities"] == ["text"]
    assert session["audio"]["output"]["voice"] == "chelsie" and session["audio"]["input"]["turn_detection"] is None


async def test_sdk_mints_a_secret_whose_sessions_start_with_its_settings(keyed_server):
    before = time.time()
    secret = await sdk(keyed_server, KEY).realtime.client_secrets.create(session=SESSION)
    after = time.time()
    assert secret.value.startswith("ek_") and KEY not in secret.value
    assert int(before) + 60 <= secret.expires_at <= int(after) + 60  # 60 s by default, as OpenAI's
    assert_ga_settings(secret.session.model_dump())
    async with sdk(keyed_server, secret.value).realtime.connect(model="tiny") as conn:  # Bearer header
        created = await asyncio.wait_for(conn.recv(), 60)
        assert created.type == "session.created"
        assert_ga_settings(created.session.model_dump())
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hi"}]})
        await conn.response.create(response={"max_output_tokens": 3})
        while (ev := await asyncio.wait_for(conn.recv(), 60)).type != "response.done":
            assert ev.type != "error", ev
        assert ev.response.status in ("completed", "incomplete") and ev.response.output_modalities == ["text"]
    async with websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols(secret.value)) as ws:
        assert ws.subprotocol == "realtime"  # the browser's way, on the same secret: it starts many sessions
        assert_ga_settings((await recv_type(ws, "session.created"))["session"])


async def test_beta_sessions_endpoint_and_a_webrtc_call(keyed_server):
    beta = await sdk(keyed_server, KEY).beta.realtime.sessions.create(
        model="tiny", voice="aiden", instructions="Be brief.", modalities=["text"],
        client_secret={"expires_after": {"anchor": "created_at", "seconds": 600}})
    assert beta.voice == "aiden" and beta.modalities == ["text"] and beta.client_secret.value.startswith("ek_")
    assert beta.client_secret.expires_at - time.time() <= 600
    value = beta.client_secret.value
    async with websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols(value, beta=True)) as ws:
        created = await recv_type(ws, "session.created")
    s = created["session"]
    assert s["voice"] == "aiden" and s["instructions"] == "Be brief." and s["modalities"] == ["text"]  # beta shape
    call = await connect(keyed_server.url, headers={"Authorization": f"Bearer {value}"})
    try:
        s = (await call.wait_for(lambda ev: ev["type"] == "session.created", 30))["session"]
        assert s["audio"]["output"]["voice"] == "aiden" and s["instructions"] == "Be brief."  # GA call, its settings
        hangup = f"{keyed_server.url}{call.location}/hangup"
        async with httpx.AsyncClient(timeout=10) as http:  # a client secret cannot hang up; the key can
            r = await http.post(hangup, headers={"Authorization": f"Bearer {value}"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "client_secret_not_allowed"
            assert (await http.post(hangup, headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    finally:
        await call.close()


async def test_a_client_secret_only_starts_sessions(keyed_server):
    value = mint_secret(keyed_server, KEY)["value"]
    with pytest.raises(openai.PermissionDeniedError):  # no secret mints more
        await sdk(keyed_server, value).realtime.client_secrets.create()
    with pytest.raises(openai.PermissionDeniedError):
        await sdk(keyed_server, value).chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                                     "content": "Hi"}])
    for method, path in (("POST", "/v1/realtime/sessions"), ("GET", "/v1/models"), ("GET", "/v1/voices")):
        r = httpx.request(method, f"{keyed_server.url}{path}", headers={"Authorization": f"Bearer {value}"},
                          json={} if method == "POST" else None, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 403 and err["code"] == "client_secret_not_allowed" and err["type"], path
    for credential in ("ek_never_minted", None):  # neither a made-up secret nor nothing mints
        headers = {} if credential is None else {"Authorization": f"Bearer {credential}"}
        r = httpx.post(f"{keyed_server.url}/v1/realtime/client_secrets", json={}, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(websockets.InvalidStatus) as exc:
        await websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols("ek_never_minted"))
    assert exc.value.response.status_code == 403
    async with websockets.connect(f"{ws_url(keyed_server)}-other", subprotocols=key_subprotocols(value)) as ws:
        err = await recv(ws)  # a session for another model than the secret's
        assert err["type"] == "error" and err["error"]["code"] == "invalid_value" and err["error"]["param"] == "model"
        with pytest.raises(websockets.ConnectionClosed):
            await recv(ws)
        assert ws.close_code == 1008


async def test_an_expired_secret_starts_nothing_and_its_session_goes_on(keyed_server):
    secret = mint_secret(keyed_server, KEY, {"expires_after": {"anchor": "created_at", "seconds": 20}})
    async with websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols(secret["value"])) as ws:
        await recv_type(ws, "session.created")
        while time.time() < secret["expires_at"]:  # the clock passes its expiry (no bound on how long it takes)
            await asyncio.sleep(0.25)
        with pytest.raises(websockets.InvalidStatus) as exc:
            await websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols(secret["value"]))
        assert exc.value.response.status_code == 403
        r = httpx.post(f"{keyed_server.url}/v1/realtime/calls", content=b"v=0\r\n", timeout=10, headers={
            "Authorization": f"Bearer {secret['value']}", "Content-Type": "application/sdp"})
        assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
        await ask(ws, "Hi", max_output_tokens=3, output_modalities=["text"])  # the session it started goes on
        done = (await until_done(ws))[-1]["response"]
        assert done["status"] in ("completed", "incomplete")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/realtime/client_secrets", {"expires_after": {"seconds": 9}}, "expires_after.seconds"),
    ("/v1/realtime/client_secrets", {"expires_after": {"seconds": 7201}}, "expires_after.seconds"),
    ("/v1/realtime/client_secrets", {"expires_after": {"seconds": "60"}}, "expires_after.seconds"),
    ("/v1/realtime/client_secrets", {"expires_after": {"anchor": "now"}}, "expires_after.anchor"),
    ("/v1/realtime/client_secrets", {"expires_after": {"sec": 60}}, "expires_after.sec"),
    ("/v1/realtime/client_secrets", {"expires_after": 60}, "expires_after"),
    ("/v1/realtime/client_secrets", {"session": {"type": "transcription"}}, "session.type"),
    ("/v1/realtime/client_secrets", {"session": {"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "objekt"}}]}}, "session.tools.0.parameters"),
    ("/v1/realtime/client_secrets", {"session": {"tool_choice": {"type": "function", "name": "f"}}},
     "session.tool_choice"),
    ("/v1/realtime/client_secrets", {"session": {"audio": {"output": {"voice": "nobody"}}}}, "session.voice"),
    ("/v1/realtime/client_secrets", {"session": {"model": "gpt-4o"}}, "session.model"),
    ("/v1/realtime/client_secrets", {"session": {"model": 4}}, "session.model"),
    ("/v1/realtime/client_secrets", {"session": {"instructions": "x" * 100_001}}, "session.instructions"),
    ("/v1/realtime/client_secrets", {"session": {"bogus": 1}}, "session.bogus"),
    ("/v1/realtime/client_secrets", {"session": "realtime"}, "session"),
    ("/v1/realtime/sessions", {"voice": "nobody"}, "voice"),
    ("/v1/realtime/sessions", {"model": "gpt-4o"}, "model"),
    ("/v1/realtime/sessions", {"client_secret": {"expires_after": {"seconds": 1}}},
     "client_secret.expires_after.seconds"),
    ("/v1/realtime/sessions", {"client_secret": "soon"}, "client_secret"),
    ("/v1/realtime/sessions", {"temperature": 9}, "temperature"),
])
def test_bad_requests_name_the_parameter(keyed_server, path, body, param):
    r = httpx.post(f"{keyed_server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code in (400, 404) and err["param"] == param and err["type"] == "invalid_request_error", r.text
    assert (r.status_code == 404) == (err["code"] == "model_not_found")


async def test_logs_carry_the_key_id_never_the_key(keyed_server):
    value = mint_secret(keyed_server, KEY)["value"]
    async with websockets.connect(ws_url(keyed_server), subprotocols=key_subprotocols(value)) as ws:
        await recv_type(ws, "session.created")
    lines = [json.loads(line) for line in keyed_server.log.read_text().splitlines() if line.startswith("{")]
    minted = [rec for rec in lines if rec["msg"].startswith("client secret minted")]
    opened = [rec for rec in lines if rec["msg"].startswith("realtime session open")]
    assert minted and all(rec["key_id"] == "cli-1" for rec in minted)
    assert opened and all(rec["key_id"] == "cli-1" for rec in opened)
    assert KEY not in keyed_server.log.read_text() and KEY not in httpx.get(f"{keyed_server.url}/metrics").text


async def test_a_server_without_keys_mints_secrets_that_carry_settings(server):
    secret = mint_secret(server, None, {"session": SESSION})
    bearer = {"Authorization": f"Bearer {secret['value']}"}
    async with websockets.connect(ws_url(server), additional_headers=bearer) as ws:
        assert_ga_settings((await recv_type(ws, "session.created"))["session"])
    with pytest.raises(websockets.InvalidStatus) as exc:  # a secret, once presented, must be a live one
        await websockets.connect(ws_url(server), subprotocols=key_subprotocols("ek_never_minted"))
    assert exc.value.response.status_code == 403
    async with websockets.connect(ws_url(server)) as ws:  # and without one, as ever
        assert (await recv_type(ws, "session.created"))["session"]["audio"]["output"]["voice"]
