"""Shared pieces of the Realtime tests: a real espeak-ng utterance, event collection with timeouts (SDK and
raw WebSocket), and the check that a response's audio deltas are all there."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.resample import resample
from tests.sse_client import pcm_samples_for_frames

UTTERANCE = "Hello there. Could you please tell me a short story about a friendly dragon?"
LEAD_S, TAIL_S = 1.0, 1.5


async def vad_turns(x: np.ndarray, batcher) -> list:
    """The turns a `TurnDetector` finds in 16 kHz `x` fed in 20 ms chunks, asking `batcher` (a `VadBatcher`) as
    `InputBuffer` does: the noise gate between turns only."""
    from omnirt.app.audio.vad import VAD_RATE, TurnDetector, VadConfig

    detector, events, chunk = TurnDetector(VadConfig()), [], VAD_RATE // 50
    for start in range(0, len(x), chunk):
        windows = detector.windows(x[start:start + chunk])
        probs = await batcher.probabilities(detector.stream, windows, between_turns=not detector.is_speaking)
        events += detector.decide(windows, probs)
    return events


async def collected_session(engine, session: dict, audio_sink=None) -> tuple:
    """(an in-process Realtime session on `engine`, started and updated with `session`; the list its events are
    collected into; the reader task that collects them, done once the session closes)."""
    from omnirt.app.audio.vad import VadBatcher
    from omnirt.app.realtime.config import initial_config
    from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession

    rt = RealtimeSession(engine, initial_config(engine.info(), "tiny", ""), RealtimeLimits(), VadBatcher(),
                         audio_sink=audio_sink)
    await rt.start()
    events: list[dict] = []

    async def drain():
        while (ev := await rt.outbox.get()) is not None:
            events.append(ev)

    reader = asyncio.create_task(drain())
    await rt.handle_event({"type": "session.update", "session": session})
    return rt, events, reader


def espeak_utterance(tmp_dir: Path, text: str = UTTERANCE) -> tuple[np.ndarray, float]:
    """(24 kHz float32 mono: 1 s silence, the spoken text, 1.5 s silence; the speech's duration in s)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (make sysdeps)")
    wav = tmp_dir / "utterance.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True, timeout=60)
    speech, rate = soundfile.read(wav, dtype="float32")
    speech = resample(speech, rate, 24000)
    silence = np.zeros(int(LEAD_S * 24000), np.float32), np.zeros(int(TAIL_S * 24000), np.float32)
    return np.concatenate([silence[0], speech, silence[1]]), len(speech) / 24000


def b64_chunks(samples: np.ndarray, chunk_ms: int = 100, rate: int = 24000) -> list[str]:
    pcm = float_to_pcm16(samples)
    step = rate * chunk_ms // 1000 * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


async def collect_until(conn, predicate, timeout: float = 120.0) -> list:
    """Events from an SDK connection up to and including the first for which predicate(ev) holds."""
    events = []

    async def run():
        async for ev in conn:
            events.append(ev)
            if predicate(ev):
                return

    await asyncio.wait_for(run(), timeout)
    return events


def response_done(events: list, response_id: str | None = None):
    for ev in events:
        if ev.type == "response.done" and (response_id is None or ev.response.id == response_id):
            return ev
    raise AssertionError("no response.done")


def ws_url(srv, model: str = "tiny") -> str:
    return f"ws://127.0.0.1:{srv.port}/v1/realtime?model={model}"


async def recv(ws, timeout: float = 60.0) -> dict:
    """The next event on a raw WebSocket (`websockets` client), parsed."""
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def recv_type(ws, kind: str, timeout: float = 60.0) -> dict:
    while (ev := await recv(ws, timeout))["type"] != kind:
        pass
    return ev


def lost_audio(events: list[dict], response_id: str) -> str | None:
    """Why the PCM16 24 kHz audio of a finished response is not whole, or None when it is: its deltas all
    come between `content_part.added` and `output_audio.done`, and together hold exactly the samples of
    every codec frame its `response.done` usage counts (a lost or duplicated delta changes the length)."""
    mine = [e for e in events if e.get("response_id") == response_id or
            e["type"] == "response.done" and e["response"]["id"] == response_id]
    kinds = [e["type"] for e in mine]
    if "response.done" not in kinds or "response.output_audio.done" not in kinds:
        return f"unfinished: {kinds[-3:]}"
    first, last = kinds.index("response.content_part.added"), kinds.index("response.output_audio.done")
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_audio.delta"]
    if deltas and not first < deltas[0] <= deltas[-1] < last:
        return "audio deltas outside the content part"
    num_samples = sum(len(base64.b64decode(mine[i]["delta"])) for i in deltas) // 2
    frames = mine[-1]["response"]["usage"]["output_token_details"]["audio_tokens"]
    if not frames or num_samples != pcm_samples_for_frames(frames):
        return f"{num_samples} samples for {frames} frames (expected {pcm_samples_for_frames(frames or 0)})"
    return None


async def ask(ws, text: str, **response) -> None:
    """A user text item, then `response.create` with `response` (raw WebSocket)."""
    await ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await ws.send(json.dumps({"type": "response.create", "response": response}))


async def until_done(ws, timeout: float = 120.0) -> list[dict]:
    """Events up to and including the next `response.done`."""
    events = [await recv(ws, timeout)]
    while events[-1]["type"] != "response.done":
        events.append(await recv(ws, timeout))
    return events


def key_subprotocols(credential: str, beta: bool = False) -> list[str]:
    """What a browser offers to carry a key or client secret on a WebSocket (it cannot set headers)."""
    return ["realtime", f"openai-insecure-api-key.{credential}", *(["openai-beta.realtime-v1"] if beta else [])]


def mint_secret(srv, key: str | None, body: dict | None = None, path: str = "/v1/realtime/client_secrets") -> dict:
    """POST a client-secret request with `key` (None: no Authorization); the JSON answer, asserting 200."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = httpx.post(f"{srv.url}{path}", json=body or {}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()
