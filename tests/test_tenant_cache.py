"""Tenants stay apart in the prefix cache: the same long prompt sent under key A, then under key B, then
under A again, on a real server with keys. B reuses nothing (`cached_tokens` 0, and the thinker computes
at least as many prompt tokens as for A's first, counted on /metrics), while A's second is served from
cache. The same over chat completions, Realtime sessions of two keys, and sessions opened with client
secrets minted from two keys (each pair of keys its own, so that one path's prompts do not warm another's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import websockets

from omnirt.loadtest.server_metrics import prefill_tokens, settled_scrape
from tests.conftest import ServerProcess
from tests.realtime_helpers import ask, key_subprotocols, mint_secret, recv_type, until_done, ws_url
from tests.test_truncation import turn_text

KEYS = {path: (f"sk-{path}-tenant-a", f"sk-{path}-tenant-b") for path in ("chat", "realtime", "secret")}


@pytest.fixture(scope="module")
def keyed_server():
    srv = ServerProcess([arg for pair in KEYS.values() for key in pair for arg in ("--api-key", key)])
    yield srv
    srv.stop()


@dataclass(frozen=True)
class Prefill:
    cached: int  # the answer's usage: prompt tokens reused from the cache
    computed: int  # the thinker's prompt tokens computed for it (/metrics)


def measured(srv: ServerProcess, send: Callable[[], int]) -> Prefill:
    """`send` one request (it returns its usage's cached tokens), with the thinker's computed tokens around it."""
    before = prefill_tokens(settled_scrape(srv.url))["thinker"]["computed"]
    cached = send()
    return Prefill(cached, int(prefill_tokens(settled_scrape(srv.url))["thinker"]["computed"] - before))


def assert_apart(srv: ServerProcess, send: Callable[[str], int], path: str) -> None:
    key_a, key_b = KEYS[path]
    a1, b1, a2 = (measured(srv, lambda k=k: send(k)) for k in (key_a, key_b, key_a))
    assert a1.computed > 200, a1  # a long prompt: a few hundred tokens
    assert b1.cached == 0 and b1.computed >= a1.computed, (a1, b1)  # B is neither warmed nor told of A's
    assert a2.cached > 200 and a2.computed < a1.computed, (a1, a2)  # A's own prompt is reused


def test_chat_completions_of_two_keys_share_no_prefix(keyed_server):
    prompt = turn_text(101)

    def send(key: str) -> int:
        r = httpx.post(f"{keyed_server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert_apart(keyed_server, send, "chat")


async def realtime_turn(srv: ServerProcess, credential: str, text: str) -> int:
    """A session opened with `credential` (a key or a client secret, as a browser carries it), one text
    turn; its `response.done` usage's cached tokens."""
    async with websockets.connect(ws_url(srv), subprotocols=key_subprotocols(credential)) as ws:
        await recv_type(ws, "session.created")
        await ask(ws, text, output_modalities=["text"], max_output_tokens=2)
        done = (await until_done(ws))[-1]
    assert done["response"]["status"] in ("completed", "incomplete"), json.dumps(done)[:500]
    return done["response"]["usage"]["input_token_details"]["cached_tokens"]


def sync_turn(srv: ServerProcess, credential: str, text: str) -> int:
    return asyncio.run(realtime_turn(srv, credential, text))


def test_realtime_sessions_of_two_keys_share_no_prefix(keyed_server):
    assert_apart(keyed_server, lambda key: sync_turn(keyed_server, key, turn_text(102)), "realtime")


def test_sessions_of_client_secrets_from_two_keys_share_no_prefix(keyed_server):
    def send(key: str) -> int:
        secret = mint_secret(keyed_server, key)["value"]
        return sync_turn(keyed_server, secret, turn_text(103))

    assert_apart(keyed_server, send, "secret")
