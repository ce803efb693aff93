"""Shared pieces of the framework tests (tests/test_framework_*.py), which drive pipecat's, LiveKit Agents' and
the OpenAI Agents SDK's own Realtime clients at their defaults with only the URL changed: a wire tap that
records every event a client sends and receives (what the assertions read, and the transcript a failure
shows), and a spoken turn fed through a framework's own audio input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from omnirt.app.audio.pcm import float_to_pcm16
from tests.conftest import until

API_KEY = "sk-test"  # the frameworks insist on a key; the server (no --api-key) takes any
CHUNK_MS = 100
MAX_TRAILING_SILENCE_S = 10.0  # more than any default turn detection waits (OpenAI's semantic_vad "low": 8 s)


class WireTap:
    """Every event one client sent (`sent`) and received (`received`), parsed, in order."""

    def __init__(self) -> None:
        self.urls: list[str] = []  # the URL of each connection, as the client opened it
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []

    def wrap_connect(self, connect: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`connect` (a `websockets` client's) whose connections record through this tap."""

        async def tapped(*args, **kwargs):
            self.urls.append(args[0] if args else kwargs.get("uri") or kwargs["url"])
            return _TappedConnection(await connect(*args, **kwargs), self)

        return tapped

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.received if e["type"] == kind]

    def sent_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.sent if e["type"] == kind]

    def function_outputs(self) -> list[dict[str, Any]]:
        """The `function_call_output` items the client sent (a tool's result)."""
        items = [e["item"] for e in self.sent_of("conversation.item.create")]
        return [item for item in items if item["type"] == "function_call_output"]

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.of("error")]

    def done(self) -> list[dict[str, Any]]:
        """The `response` of every `response.done` so far."""
        return [e["response"] for e in self.of("response.done")]

    async def until(self, predicate: Callable[[], Any], what: str) -> None:
        """`conftest.until`, failing at once when an `error` event comes instead."""
        await until(lambda: predicate() or self.errors(), what)
        assert not self.errors(), f"{what}: {self.errors()}\n{self.transcript()}"

    async def until_done(self, count: int, what: str) -> dict[str, Any]:
        """The `count`-th response's `response.done` body, once it came."""
        await self.until(lambda: len(self.done()) >= count, what)
        return self.done()[count - 1]

    def transcript(self) -> str:
        """The wire, one line an event (audio payloads left out), for a failure's message."""
        lines = [f">> {_short(e)}" for e in self.sent] + [f"<< {_short(e)}" for e in self.received]
        return "\n".join(lines)


class _TappedConnection:
    """A `websockets` client connection that records what passes through `send`, `recv` and iteration."""

    def __init__(self, conn: Any, tap: WireTap) -> None:
        self._conn, self._tap = conn, tap

    async def send(self, message, *args, **kwargs):
        self._tap.sent.append(json.loads(message))
        return await self._conn.send(message, *args, **kwargs)

    async def recv(self, *args, **kwargs):
        message = await self._conn.recv(*args, **kwargs)
        self._tap.received.append(json.loads(message))
        return message

    async def __aiter__(self):
        async for message in self._conn:
            self._tap.received.append(json.loads(message))
            yield message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _short(event: dict[str, Any]) -> str:
    event = {k: ("..." if k in ("audio", "delta") and event["type"].endswith(("append", "audio.delta")) else v)
             for k, v in event.items()}
    return json.dumps(event)[:300]


def pcm16_chunks(samples: np.ndarray, chunk_ms: int = CHUNK_MS, rate: int = 24000) -> list[bytes]:
    pcm = float_to_pcm16(samples)
    step = rate * chunk_ms // 1000 * 2
    return [pcm[i:i + step] for i in range(0, len(pcm), step)]


async def speak(push: Callable[[bytes], Awaitable[None] | None], samples: np.ndarray,
                turn_ended: Callable[[], bool]) -> None:
    """Speech (24 kHz float32) through a framework's audio input, then silence until its turn detection
    ends the turn (`turn_ended`), as a microphone would keep sending. About 4x real time."""
    silence = bytes(2 * 24000 * CHUNK_MS // 1000)
    chunks = pcm16_chunks(samples)
    for chunk in chunks:
        await _push(push, chunk)
    for _ in range(int(MAX_TRAILING_SILENCE_S * 1000 / CHUNK_MS)):
        if turn_ended():
            return
        await _push(push, silence)
    await until(turn_ended, "the turn detection ended the turn")


async def _push(push, chunk: bytes) -> None:
    if (pending := push(chunk)) is not None:
        await pending
    await asyncio.sleep(CHUNK_MS / 4000)
