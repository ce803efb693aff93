"""The WebSocket protocol the server reads with (`omnirt.app.transports.ws_protocol`): every message arrives, in
order, whatever their sizes; reading pauses only when messages pile up for the app, never once per message, and
resumes once the app has taken them."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from omnirt.app.transports import ws_protocol
from tests.conftest import free_port

pytestmark = pytest.mark.skipif(ws_protocol.PROTOCOL is None, reason="uvicorn without its sans-I/O protocol")


class _CountingTransport:
    """The connection's transport, counting the protocol's pauses and resumes."""

    def __init__(self, transport, counts: dict[str, int]):
        self._transport, self._counts = transport, counts

    def pause_reading(self) -> None:
        self._counts["pauses"] += 1
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._counts["resumes"] += 1
        self._transport.resume_reading()

    def __getattr__(self, name):
        return getattr(self._transport, name)


@contextlib.asynccontextmanager
async def _server(endpoint):
    counts = {"pauses": 0, "resumes": 0}

    class Counting(ws_protocol.PROTOCOL):
        def connection_made(self, transport) -> None:
            super().connection_made(_CountingTransport(transport, counts))

    port = free_port()
    app = Starlette(routes=[WebSocketRoute("/ws", endpoint)])
    server = uvicorn.Server(uvicorn.Config(app, port=port, loop="asyncio", ws=Counting, log_level="warning",
                                           ws_per_message_deflate=False, ws_max_size=2**22))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"ws://127.0.0.1:{port}/ws", counts
    finally:
        server.should_exit = True
        await task


async def _echo_count(ws) -> None:
    """Reads every message; at "end", answers how many came and whether they came in order."""
    await ws.accept()
    seen: list[str | bytes] = []
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        data = msg.get("text") if msg.get("text") is not None else msg.get("bytes")
        if data == "end":
            await ws.send_text(json.dumps({"num": len(seen), "firsts": [m[:8] for m in seen if isinstance(m, str)]}))
            seen = []
        else:
            seen.append(data)


async def test_messages_paced_one_at_a_time_never_pause_reading():
    async with _server(_echo_count) as (url, counts), websockets.connect(url, compression=None) as client:
        for i in range(200):
            await client.send(json.dumps({"i": i}))
            await asyncio.sleep(0)
        await client.send("end")
        answer = json.loads(await client.recv())
    assert answer["num"] == 200 and answer["firsts"] == [json.dumps({"i": i})[:8] for i in range(200)]
    assert counts["pauses"] <= 200 // ws_protocol.MAX_QUEUED_MESSAGES  # uvicorn's own paused after each message


async def test_a_backlog_pauses_reading_until_the_app_takes_it_and_nothing_is_lost():
    go = asyncio.Event()

    async def slow(ws):
        await ws.accept()
        await go.wait()  # messages pile up meanwhile
        await _read_all(ws)

    async def _read_all(ws):
        got = []
        while (msg := await ws.receive())["type"] != "websocket.disconnect":
            data = msg.get("text") if msg.get("text") is not None else msg.get("bytes")
            if data == "end":
                await ws.send_text(json.dumps([len(m) for m in got]))
                return
            got.append(data)

    big = "x" * (ws_protocol.LARGE_MESSAGE_BYTES + 10)
    sent = [json.dumps({"i": i}) for i in range(100)] + [big, b"\x01" * 3, big] + ["y" * 300] * 50
    async with _server(slow) as (url, counts), websockets.connect(url, compression=None, max_size=2**22) as client:
        for m in sent:
            await client.send(m)
        await client.send("end")
        while counts["pauses"] == 0:  # the protocol has read what it holds and stopped reading
            await asyncio.sleep(0.01)
        go.set()
        sizes = json.loads(await client.recv())
    assert sizes == [len(m) for m in sent]
    assert counts["pauses"] >= 1 and counts["resumes"] >= 1
    assert counts["pauses"] < len(sent) // 2  # not one a message


async def test_a_client_that_reads_nothing_holds_a_bounded_amount_before_sends_wait():
    """The server's send buffer is bounded (`SEND_BUFFER_BYTES`), so a send to a client that stopped reading waits
    (and `--slow-client-timeout` can fire) after some hundreds of KiB, not the 4 MiB Linux would let queue."""
    import socket

    message, sent = "z" * 16 * 2**10, {"bytes": 0}

    async def flood(ws):
        await ws.accept()
        with contextlib.suppress(TimeoutError):
            while True:
                async with asyncio.timeout(5):  # a send that waits this long: the buffers are full
                    await ws.send_text(message)
                sent["bytes"] += len(message)

    async with _server(flood) as (url, _):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's kernel holds little
        sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0])))
        async with websockets.connect(url, sock=sock, compression=None, max_queue=1, max_size=2**22):
            last = -1
            while sent["bytes"] != last:  # reads nothing, until the server's sends stop
                last = sent["bytes"]
                await asyncio.sleep(6)
    kernel_and_transport = 2 * ws_protocol.SEND_BUFFER_BYTES + 2**16  # Linux doubles SO_SNDBUF; asyncio's high water
    assert 2**16 <= sent["bytes"] <= kernel_and_transport + 2**18, sent  # + what the client side holds
