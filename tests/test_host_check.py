"""The guard against DNS rebinding (`omnirt.app.ops.hosts`): a request whose `Host` names something the server does
not answer to is refused before anything else runs, over HTTP reads and posts and WebSocket handshakes;
localhost, IP literals (IPv6 bracketed), `--host` and `--allowed-hosts` names pass, at any port; `*` turns
the guard off. The origin check then takes a page as same-origin only under a name the server answers to."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from omnirt.app.api_process import server_settings
from omnirt.app.flags import build_parser
from omnirt.app.ops import security
from omnirt.app.ops.hosts import HostRule, hostname
from omnirt.app.ops.keys import KeyRing
from omnirt.app.ops.secret_store import SecretStore

REBOUND = "attacker.example:8091"  # a name its owner re-pointed at 127.0.0.1


def guarded_app(allowed_hosts: tuple[str, ...] = ("127.0.0.1",)) -> FastAPI:
    """The server's security middleware, as `create_app` installs it, in front of a read, a post and a socket."""
    app = FastAPI()

    @app.get("/v1/models")
    async def read():
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def post():
        return {"ok": True}

    @app.websocket("/v1/realtime")
    async def socket(ws: WebSocket):
        await ws.accept()
        await ws.send_text("ok")
        await ws.close()

    security.install(app, KeyRing(), SecretStore(), None, (), allowed_hosts)
    return app


def answers(app: FastAPI, host: str, origin: str | None = None) -> tuple[int, int, str]:
    """The statuses of a read and a post, and what the WebSocket says ("refused <code>" before accept)."""
    headers = {"Origin": origin} if origin else {}
    with TestClient(app, base_url=f"http://{host}", headers=headers) as client:
        read, post = client.get("/v1/models"), client.post("/v1/chat/completions", json={})
        for r in (read, post):
            assert r.status_code == 200 or r.json()["error"]["code"] in ("host_not_allowed", "origin_not_allowed")
        try:
            with client.websocket_connect(f"ws://{host}/v1/realtime") as ws:
                said = ws.receive_text()
        except WebSocketDisconnect as exc:
            said = f"refused {exc.code}"
    return read.status_code, post.status_code, said


def test_a_rebinding_pair_is_refused_on_every_route():
    assert answers(guarded_app(), REBOUND, f"http://{REBOUND}") == (403, 403, "refused 1008")
    assert answers(guarded_app(), REBOUND) == (403, 403, "refused 1008")  # with or without an Origin


@pytest.mark.parametrize("host", ["localhost", "localhost:8091", "app.localhost:3000", "127.0.0.1:8091",
                                  "127.0.0.1", "[::1]:8091", "[::1]", "192.168.1.20:9000", "LOCALHOST."])
def test_localhost_and_ip_literals_pass_at_any_port(host):
    assert answers(guarded_app(), host, f"http://{host}") == (200, 200, "ok")


def test_allowed_hosts_names_pass_and_star_turns_the_guard_off():
    app = guarded_app(("voice.example", ".corp.example"))
    for host in ("voice.example", "voice.example:443", "corp.example", "a.b.corp.example:8091"):
        assert answers(app, host, f"http://{host}") == (200, 200, "ok"), host
    for host in ("evil.example", "voice.example.evil.example", "xcorp.example"):
        assert answers(app, host) == (403, 403, "refused 1008"), host
    assert answers(guarded_app(("*",)), REBOUND, f"http://{REBOUND}") == (200, 200, "ok")


def test_an_allowed_host_does_not_let_another_origin_in():
    """Same-origin means the `Host`'s name and port; a listed name does not open the server to other pages."""
    app = guarded_app(("voice.example",))
    assert answers(app, "voice.example", "http://evil.example") == (200, 403, "refused 1008")
    assert answers(app, "localhost:8091", "http://localhost:9999") == (200, 403, "refused 1008")


@pytest.mark.parametrize("value, name", [
    ("Example.COM:80", "example.com"), ("[::1]:8091", "::1"), ("[::1]", "::1"), ("localhost.", "localhost"),
    ("::1", None), ("[::1]x", None), ("[evil.example]:80", None), ("", None), (":8091", None)])
def test_host_values_are_parsed_into_a_name(value, name):
    assert hostname(value) == name


def test_the_rule_of_the_flags():
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts", "a.example, b.example:8091"])
    settings = server_settings(args, SimpleNamespace(system_prompt=None, front_end=None))  # the profile's part
    assert settings.allowed_hosts == ("a.example", "b.example:8091", "0.0.0.0")
    rule = HostRule.of(settings.allowed_hosts)
    assert rule.allows("b.example") and rule.allows("10.0.0.7") and not rule.allows("c.example")


def test_a_real_server_refuses_a_rebinding_pair(server):
    import websocket  # websocket-client: it sends the Host it is given, as a browser would for the page's name

    headers = {"Host": REBOUND, "Origin": f"http://{REBOUND}"}
    for r in (httpx.get(f"{server.url}/", headers=headers, timeout=30),
              httpx.post(f"{server.url}/v1/realtime/client_secrets", headers=headers, json={}, timeout=30)):
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    with pytest.raises(websocket.WebSocketBadStatusException) as exc:
        websocket.create_connection(server.url.replace("http", "ws") + "/v1/realtime", timeout=30, host=REBOUND,
                                    origin=f"http://{REBOUND}")
    assert exc.value.status_code == 403
    assert f"refused WebSocket /v1/realtime for Host {REBOUND!r}" in server.log.read_text()
    own = {"Host": f"localhost:{server.port}", "Origin": f"http://localhost:{server.port}"}
    assert httpx.get(f"{server.url}/", headers=own, timeout=30).status_code == 200
