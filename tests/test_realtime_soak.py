"""Realtime soak: N concurrent clients against a real server for a bounded time, each opening a WebSocket
session, doing TURNS_PER_SESSION turns and closing it, over and over. A session's turns are of one kind,
in rotation: a text item + `response.create`; an audio item (`input_audio_buffer.append` + `commit`) +
`response.create`; or a server-VAD turn (spoken audio, then silence: the server detects the end of speech
and starts the response itself). Every finished response must carry its whole audio (`lost_audio`: the
deltas' PCM == every codec frame its usage counts, all inside the content part); no `error` event; the
server's memory must plateau under `make soak` (tests/soak_helpers.py; CI only reports it); every session
ends counted in /metrics and all slots are free at the end. CI runs 6 clients for 30 s; `make soak` runs
64 for 600 s (OMNIRT_RT_SOAK_N, OMNIRT_RT_SOAK_S). In process, no session object outlives its connection."""

from __future__ import annotations

import asyncio
import base64
import collections
import gc
import json
import os
import time
from dataclasses import dataclass, field

import pytest
import websockets
from starlette.testclient import TestClient

from omnirt.app.realtime.input_buffer import InputBuffer
from omnirt.app.realtime.response import Response
from omnirt.app.realtime.session import RealtimeSession
from omnirt.app.server import create_app
from omnirt.app.state import ServerSettings, app_state
from tests.conftest import ServerProcess, until, wait_for
from tests.realtime_helpers import ask, b64_chunks, espeak_utterance, lost_audio, recv_type, until_done, ws_url
from tests.soak_helpers import RssSampler, check_plateau, report
from tests.sse_client import pcm_samples_for_frames

NUM_CLIENTS = int(os.environ.get("OMNIRT_RT_SOAK_N", "6"))
DURATION_S = float(os.environ.get("OMNIRT_RT_SOAK_S", "30"))
TURNS_PER_SESSION = 4
KINDS = ("text", "audio", "vad")
TURN_TIMEOUT_S = 300.0
# the responses server VAD starts take the profile's defaults: keep them short (8 tokens, <= 40 frames)
CHEAP = json.dumps({"0": {"default_sampling_params": {"max_tokens": 8}},
                    "1": {"default_sampling_params": {"max_tokens": 40}}})
VAD = {"type": "server_vad", "create_response": True, "interrupt_response": False}


@dataclass
class Tally:
    sessions: int = 0
    turns: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    audio_deltas: int = 0
    audio_samples: int = 0
    lost: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)

    def check(self, kind: str, events: list[dict]) -> None:
        """Tally one turn's events; a finished response must have all its audio."""
        self.turns[kind] += 1
        self.errors += [e["error"] for e in events if e["type"] == "error"]
        for done in (e["response"] for e in events if e["type"] == "response.done"):
            self.statuses[done["status"]] += 1
            if done["status"] in ("completed", "incomplete"):
                if (why := lost_audio(events, done["id"])) is not None:
                    self.lost.append(f"{kind} {done['id']}: {why}")
                self.audio_samples += pcm_samples_for_frames(done["usage"]["output_token_details"]["audio_tokens"])
        self.audio_deltas += sum(e["type"] == "response.output_audio.delta" for e in events)


async def _turn(ws, kind: str, n: int, speech: list[str]) -> None:
    frames = 20 + 7 * (n % 7)
    options = {"max_output_tokens": 4 + n % 5, "talker_sampling": {"min_tokens": frames, "max_tokens": frames}}
    if kind == "text":
        return await ask(ws, "Tell me something nice.", **options)
    for chunk in speech:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
    if kind == "audio":
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create", "response": options}))


async def _session(url: str, kind: str, n: int, speech: list[str], tally: Tally, end_at: float) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": VAD if kind == "vad" else None}}}}))
        await recv_type(ws, "session.updated")
        tally.sessions += 1
        for t in range(TURNS_PER_SESSION):
            await _turn(ws, kind, n + t, speech)
            tally.check(kind, await until_done(ws, TURN_TIMEOUT_S))
            if time.monotonic() > end_at:
                return


async def _client(url: str, i: int, speech: list[str], tally: Tally, end_at: float) -> None:
    n = 0
    while time.monotonic() < end_at:
        await _session(url, KINDS[(i + n) % len(KINDS)], i + n, speech, tally, end_at)
        n += 1


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> list[str]:
    """A spoken request with 1 s of silence before and 1.5 s after, as 200 ms base64 PCM16 chunks."""
    samples, _ = espeak_utterance(tmp_path_factory.mktemp("speech"), "Please tell me a story about the sea.")
    return b64_chunks(samples, chunk_ms=200)


async def test_realtime_soak(speech):
    # headroom over NUM_CLIENTS: a client that reconnects at once may see its old session still closing
    srv = ServerProcess(["--stage-overrides", CHEAP, "--realtime-max-sessions", str(max(32, 2 * NUM_CLIENTS))])
    try:
        tally, started = Tally(), time.monotonic()
        with RssSampler(srv.proc.pid) as rss:
            await asyncio.gather(*(_client(ws_url(srv), i, speech, tally, started + DURATION_S)
                                   for i in range(NUM_CLIENTS)))
        elapsed = time.monotonic() - started
        h = await asyncio.to_thread(srv.wait_idle)
        await until(lambda: srv.metric("omnirt_sessions_active", transport="websocket") == 0, "every session closed")
        summary = {"clients": NUM_CLIENTS, "duration_s": round(elapsed, 1), "sessions": tally.sessions,
                   "turns": dict(tally.turns), "responses": dict(tally.statuses), "audio_deltas": tally.audio_deltas,
                   "audio_s": round(tally.audio_samples / 24000, 1), "lost": len(tally.lost),
                   "errors": len(tally.errors), **rss.summary(), "slots_free_at_end": h["free_slots"] == h["slots"],
                   "sessions_closed_metric": srv.metric("omnirt_sessions_total", transport="websocket",
                                                        state="closed")}
        report(f"realtime-soak-{NUM_CLIENTS}x{int(DURATION_S)}s", summary)
        assert set(tally.turns) == set(KINDS) and sum(tally.statuses.values()) >= sum(tally.turns.values())
        assert not tally.lost and not tally.errors, (tally.lost[:5], tally.errors[:5])
        assert set(tally.statuses) <= {"completed", "incomplete"}, tally.statuses
        check_plateau(summary)
        assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
        assert srv.metric("omnirt_sessions_active", transport="websocket") == 0
        assert summary["sessions_closed_metric"] == tally.sessions
    finally:
        srv.stop()


def test_lost_audio_notices_a_missing_or_misplaced_delta():
    """The soak's check itself: whole audio passes; one delta dropped, or one after `output_audio.done`, fails."""
    pcm = b"\0\1" * pcm_samples_for_frames(5)
    deltas = [{"type": "response.output_audio.delta", "response_id": "r", "delta": base64.b64encode(p).decode()}
              for p in (pcm[:3000], pcm[3000:])]
    done = {"type": "response.done", "response": {"id": "r", "usage": {"output_token_details": {"audio_tokens": 5}}}}
    part, end = ({"type": t, "response_id": "r"} for t in ("response.content_part.added", "response.output_audio.done"))
    assert lost_audio([part, *deltas, end, done], "r") is None
    assert "samples for 5 frames" in lost_audio([part, deltas[1], end, done], "r")
    assert "outside" in lost_audio([part, deltas[0], end, deltas[1], done], "r")


def test_no_session_outlives_its_connection(engine, speech):
    """In process: 12 sessions, each with a spoken turn, open and close; afterwards no RealtimeSession,
    InputBuffer (with its VAD) or Response object is left (a leak per session would keep them)."""
    app = create_app(engine, ServerSettings())
    with TestClient(app) as client:
        for _ in range(12):
            with client.websocket_connect("ws://localhost/v1/realtime") as ws:
                ws.receive_json()
                ws.send_json({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
                for chunk in speech:
                    ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
                ws.send_json({"type": "input_audio_buffer.commit"})
                ws.send_json({"type": "response.create", "response": {"max_output_tokens": 2,
                                                                      "talker_sampling": {"max_tokens": 8}}})
                while ws.receive_json()["type"] != "response.done":
                    pass
        wait_for(lambda: not app_state(app).sessions.sessions, "every session gone", poll_s=0.05)
    gc.collect()
    kinds = (RealtimeSession, InputBuffer, Response)
    alive = collections.Counter(type(o).__name__ for o in gc.get_objects() if type(o) in kinds)
    assert not alive and not app_state(app).sessions.sessions, alive
