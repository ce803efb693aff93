"""Abusive sessions beside the normal ones (`omnirt bench realtime --abusive N`): flooding audio, malformed events,
not reading; what the server answered."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
from collections import Counter

from omnirt.loadtest.realtime_mic import chunks, session_update, utterance

ABUSE_KINDS = ("flood", "garbage", "deaf")
FLOOD_CHUNK_S = 0.5  # audio per append of a flood: the server's cost per event does not pace it


async def _abuse_once(kind: str, url: str, speech: list[str], stop: asyncio.Event, args: argparse.Namespace) -> dict:
    """One abusive connection: `flood` sends speech as fast as the socket takes it, `garbage` sends
    malformed events and audio in a wrong format, `deaf` asks for a long reply and reads nothing. What
    the server answered: its error codes and how it closed the connection."""
    import socket

    import websockets

    record = {"kind": kind, "errors": [], "close_code": None, "close_reason": None}
    host, port = url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    sock = socket.socket()
    if kind == "deaf":  # a small receive window (set before connecting), so the server's writes back up soon
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        async with websockets.connect(url, sock=sock, max_size=None, max_queue=1 if kind == "deaf" else 16,
                                      open_timeout=60) as ws:
            await ws.send(json.dumps(session_update(args, -1)))
            if kind == "flood":
                reader = asyncio.create_task(_errors(ws, record))
                with contextlib.suppress(websockets.ConnectionClosed):
                    while not stop.is_set():
                        for chunk in speech:
                            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                            await asyncio.sleep(0)  # a send that does not wait on the socket yields nothing
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader, 30)
            elif kind == "garbage":
                for raw in _GARBAGE:
                    await ws.send(raw)
                await asyncio.wait_for(_errors(ws, record, until=len(_GARBAGE)), 30)
            else:
                await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}}))
                await ws.send(json.dumps({"type": "response.create", "response": {
                    "talker_sampling": {"min_tokens": 8000, "max_tokens": 8000}}}))
                await asyncio.sleep(args.deaf_s)  # read nothing (past `stop` too); the server should give up
                await asyncio.wait_for(_errors(ws, record), 30)
    except websockets.ConnectionClosed as exc:
        record["close_code"], record["close_reason"] = (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else (None, None)
    except Exception as exc:  # noqa: BLE001 - a refused or dropped connection is a result
        record["errors"].append(type(exc).__name__)
    return record


_GARBAGE = ("not json", json.dumps({"type": "no.such.event"}),
            json.dumps({"type": "input_audio_buffer.append", "audio": "***"}),
            json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}),
            json.dumps({"type": "session.update", "session": {"voice": "no-such-voice"}}))


async def _errors(ws, record: dict, until: int | None = None) -> None:
    """Read events, noting `error` codes, until the connection closes (or `until` errors arrived)."""
    import websockets

    try:
        async for raw in ws:
            ev = json.loads(raw)
            if ev["type"] == "error":
                record["errors"].append(ev["error"].get("code"))
                if until is not None and len(record["errors"]) >= until:
                    return
    except websockets.ConnectionClosed as exc:
        if exc.rcvd:
            record["close_code"], record["close_reason"] = exc.rcvd.code, exc.rcvd.reason
        raise


def abusers_main(n: int, args: argparse.Namespace, stop, outbox) -> None:
    """N abusive sessions, each going through the kinds in turn (a new connection each time) until `stop`."""

    async def run() -> list[dict]:
        speech, done, records = chunks(utterance(args.wav)[0], FLOOD_CHUNK_S), asyncio.Event(), []
        url = args.url.replace("http", "ws", 1) + f"/v1/realtime?model={args.model}"

        async def one(i: int) -> None:
            k = i
            while not done.is_set():
                records.append(await _abuse_once(ABUSE_KINDS[k % len(ABUSE_KINDS)], url, speech, done, args))
                k += 1

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.2)
            done.set()

        await asyncio.gather(watch(), *(one(i) for i in range(n)))
        return records

    outbox.put(asyncio.run(run()))




def abuse_summary(records: list[dict]) -> dict:
    """Per abuse kind: connections, how the server closed them, and the error codes it sent."""
    out: dict[str, dict] = {}
    for r in records:
        k = out.setdefault(r["kind"], {"connections": 0, "closes": Counter(), "errors": Counter()})
        k["connections"] += 1
        k["closes"][f"{r['close_code']} {r['close_reason'] or ''}".strip()] += 1
        k["errors"].update(str(e) for e in r["errors"])
    return {kind: {**v, "closes": dict(v["closes"]), "errors": dict(v["errors"])} for kind, v in out.items()}

