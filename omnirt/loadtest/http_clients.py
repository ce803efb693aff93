"""What the HTTP stack adds to a first audio packet, without the engine: a synthetic SSE server shaped like omnirt's
`/v1/chat/completions` stream (a text delta every 12 ms, a 15 KiB audio chunk at the 26th event) under uvicorn with
h11 or httptools, and `omnirt bench`'s two candidate clients (httpx, aiohttp) at concurrency c, all on loopback.
Prints per combination the means of: intake (client send -> handler start, the server's stamp), the audio leg
(server yield -> client parse of the audio event) and the first packet itself. The server's clock and the
client's are the same monotonic clock (one host).

    python -m omnirt.loadtest.http_clients --concurrency 64 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time

AUDIO = base64.b64encode(os.urandom(15360)).decode()
EVENTS, AUDIO_AT, EVERY_S = 60, 25, 0.012


def app():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def chat(request):
        t_in = time.perf_counter()
        await request.json()

        async def stream():
            yield event({"choices": [{"delta": {"role": "assistant"}}], "t_in": t_in})
            for i in range(EVENTS):
                await asyncio.sleep(EVERY_S)
                if i == AUDIO_AT:
                    yield event({"choices": [{"delta": {"audio": {"data": AUDIO}}}], "t_out": time.perf_counter()})
                yield event({"object": "chat.completion.chunk", "choices": [{"delta": {"audio": {"transcript": "w"}}}]})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _times(line: str, t0: float, out: dict) -> None:
    if line.startswith("data: {"):
        chunk, now = json.loads(line[6:]), time.perf_counter()
        if "t_in" in chunk:
            out["intake"] = chunk["t_in"] - t0
        if "t_out" in chunk:
            out["leg"], out["ttfp"] = now - chunk["t_out"], now - t0


async def _httpx(url: str, c: int) -> list[dict]:
    import httpx

    async def one(client) -> dict:
        out, t0 = {}, time.perf_counter()
        async with client.stream("POST", url, json={"messages": []}) as r:
            async for line in r.aiter_lines():
                _times(line, t0, out)
        return out

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=c + 8), timeout=60) as client:
        return await asyncio.gather(*(one(client) for _ in range(c)))


async def _aiohttp(url: str, c: int) -> list[dict]:
    import aiohttp

    async def one(session) -> dict:
        out, t0 = {}, time.perf_counter()
        async with session.post(url, json={"messages": []}) as r:
            async for raw in r.content:
                _times(raw.decode().rstrip("\r\n"), t0, out)
        return out

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c + 8), read_bufsize=2**22) as session:
        return await asyncio.gather(*(one(session) for _ in range(c)))


async def measure(client: str, url: str, c: int, rounds: int) -> dict[str, float]:
    run = _httpx if client == "httpx" else _aiohttp
    samples = [s for _ in range(rounds + 1) for s in await run(url, c)][c:]  # the first round warms up
    return {k: statistics.fmean(s[k] for s in samples) * 1000 for k in ("intake", "leg", "ttfp")}


def _wait_for(port: int, timeout_s: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--serve", choices=["h11", "httptools"], help=argparse.SUPPRESS)  # the server's own process
    args = p.parse_args()
    if args.serve:
        import uvicorn

        uvicorn.run(app(), host="127.0.0.1", port=args.port, loop="asyncio", http=args.serve, log_level="warning")
        return
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    print(f"| server parser | client | intake ms | audio leg ms | first packet ms |  (c={args.concurrency}, "
          f"{args.rounds} rounds)\n|---|---|---|---|---|")
    for parser in ("h11", "httptools"):
        server = subprocess.Popen([sys.executable, "-m", "omnirt.loadtest.http_clients", "--serve", parser,
                                   "--port", str(args.port)])
        try:
            _wait_for(args.port)
            for client in ("httpx", "aiohttp"):
                m = asyncio.run(measure(client, url, args.concurrency, args.rounds))
                print(f"| {parser} | {client} | {m['intake']:.1f} | {m['leg']:.1f} | {m['ttfp']:.1f} |", flush=True)
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
