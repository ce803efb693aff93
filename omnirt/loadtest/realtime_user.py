"""Locust user: a Realtime WebSocket session (OpenAI GA protocol) on /v1/realtime. Spoken audio is
sent paced in real time as base64 PCM16 24 kHz `input_audio_buffer.append` events, with server VAD
ending each turn; a share of users barge in while the answer plays. Reported: connect, turn latency
(end of speech -> first `response.output_audio.delta`), first audio after `speech_stopped`, gaps,
underruns, and barge-in stop time (interrupt sent -> last audio delta of the cancelled response).
Skipped, with a message, when the server has no /v1/realtime (see locustfile.py)."""

from __future__ import annotations

import base64
import collections
import json
import os
import random
import time

import gevent
import websocket
from gevent.queue import Empty, Queue
from locust import User, between, task

from omnirt.app.audio.wire import PCM16
from omnirt.loadtest.audio_metrics import AudioTrace
from omnirt.loadtest.speech import pcm16, speech

RATE, CHUNK_MS = PCM16.sample_rate, 40
CHUNK_BYTES = RATE * 2 * CHUNK_MS // 1000
TURN_TIMEOUT_S = 90.0
SESSION = {"type": "realtime", "output_modalities": ["audio"],
           "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE},
                               "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                                  "silence_duration_ms": 500}},
                     "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": "ethan"}}}


def ws_url(host: str) -> str:
    return host.replace("https://", "wss://").replace("http://", "ws://").rstrip("/") + \
        f"/v1/realtime?model={os.environ.get('OMNIRT_LOADTEST_MODEL', 'tiny')}"


def auth_header() -> list[str]:
    key = os.environ.get("OMNIRT_API_KEY")
    return [f"Authorization: Bearer {key}"] if key else []


def realtime_available(host: str) -> tuple[bool, str]:
    """Probe once: does the server accept a WebSocket on /v1/realtime?"""
    try:
        websocket.create_connection(ws_url(host), header=auth_header(), timeout=10).close()
        return True, "ok"
    except websocket.WebSocketBadStatusException as exc:
        return False, f"handshake answered HTTP {exc.status_code}"
    except (OSError, websocket.WebSocketException) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def _chunks(audio: bytes) -> list[bytes]:
    return [audio[i:i + CHUNK_BYTES] for i in range(0, len(audio), CHUNK_BYTES)]


class RealtimeUser(User):
    wait_time = between(1, 2)
    barge_in_share = float(os.environ.get("OMNIRT_LOADTEST_BARGE_IN", "0.25"))

    def on_start(self) -> None:
        self.utterance = _chunks(pcm16(speech(RATE)))
        self.silence = b"\0" * CHUNK_BYTES
        started = time.perf_counter()
        self.ws = websocket.create_connection(ws_url(self.host), header=auth_header(), timeout=30)
        self.inbox: Queue = Queue()
        self.reader = gevent.spawn(self._read)
        self._expect("session.created", 30)
        self._fire("realtime", "connect", started)
        self._send({"type": "session.update", "session": SESSION})
        self._expect("session.updated", 30)

    def on_stop(self) -> None:
        self.ws.close()
        self.reader.kill()

    @task
    def turn(self) -> None:
        """Speak, keep streaming silence like a live microphone, and follow the answer to `response.done`."""
        will_barge = random.random() < self.barge_in_share
        outgoing = collections.deque(self.utterance)
        started, tick, trace, trace_rid = time.perf_counter(), 0, None, None
        barged, barged_rid, interrupt_at, stopped_at = None, None, None, None
        while time.perf_counter() - started < TURN_TIMEOUT_S:
            chunk = outgoing.popleft() if outgoing else self.silence
            self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            if not outgoing and trace is None:  # the end of this utterance: the turn latency starts here
                trace, trace_rid, stopped_at = AudioTrace(time.perf_counter()), None, None
            tick += 1
            gevent.sleep(max(0.0, started + tick * CHUNK_MS / 1000 - time.perf_counter()))  # real-time pacing
            for at, ev in self._drain():
                kind = ev.get("type")
                if kind == "error":
                    self._fail("turn", started, f"error event: {ev.get('error')}")
                    return
                if kind == "input_audio_buffer.speech_stopped" and trace is not None:
                    stopped_at = at
                elif kind == "response.created" and trace is not None and at >= trace.started:
                    trace_rid = ev.get("response", {}).get("id")  # the answer to this turn, not to a pause in it
                elif kind == "response.output_audio.delta":
                    rid = ev.get("response_id")
                    if barged is not None and rid == barged_rid:
                        barged.on_audio(base64.b64decode(ev["delta"]))
                    elif trace is not None and rid == trace_rid:
                        trace.on_audio(base64.b64decode(ev["delta"]))
                        if will_barge and interrupt_at is None and at - trace.clock.first_at > 0.4:
                            outgoing.extend(self.utterance[: 1000 // CHUNK_MS])  # 1 s of speech over the answer
                            interrupt_at, barged, barged_rid, trace = time.perf_counter(), trace, rid, None
                elif kind == "response.done":
                    rid, status = ev.get("response", {}).get("id"), ev.get("response", {}).get("status")
                    if barged is not None and rid == barged_rid:
                        if status == "cancelled":  # last audio after the interrupt (0: none came), and the cancel
                            self._fire("audio", "realtime barge_in_stop", interrupt_at,
                                       end=max(barged.clock.last_at or interrupt_at, interrupt_at))
                            self._fire("audio", "realtime barge_in_cancelled", interrupt_at, end=at)
                        barged = None
                    elif trace is not None and rid == trace_rid and status in ("completed", "incomplete"):
                        trace.report(self.environment, "realtime", first_audio_name="turn_latency")
                        if stopped_at is not None:
                            self._fire("audio", "realtime first_audio_after_speech_stopped", stopped_at,
                                       end=trace.clock.first_at)
                        self._fire("realtime", "turn", started)
                        return
        self._fail("turn", started, f"no completed response.done within {TURN_TIMEOUT_S:.0f} s")

    # ---- the wire -----------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                event = json.loads(self.ws.recv())
                self.inbox.put((time.perf_counter(), event))  # stamped on arrival, not when recv() began
        except (websocket.WebSocketException, OSError, ValueError):
            self.inbox.put((time.perf_counter(), {"type": "error", "error": "connection closed"}))

    def _send(self, event: dict) -> None:
        self.ws.send(json.dumps(event))

    def _drain(self) -> list[tuple[float, dict]]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except Empty:
                return out

    def _expect(self, kind: str, timeout: float) -> dict:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:
                _, ev = self.inbox.get(timeout=max(0.01, deadline - time.perf_counter()))
            except Empty:
                break
            if ev.get("type") == kind:
                return ev
            if ev.get("type") == "error":
                raise RuntimeError(f"waiting for {kind}: {ev.get('error')}")
        raise TimeoutError(f"no {kind} within {timeout:.0f} s")

    def _fire(self, request_type: str, name: str, start: float, end: float | None = None) -> None:
        self.environment.events.request.fire(request_type=request_type, name=name, response_length=0, context={},
                                             response_time=1000 * ((end or time.perf_counter()) - start),
                                             exception=None)

    def _fail(self, name: str, start: float, why: str) -> None:
        self.environment.events.request.fire(request_type="realtime", name=name, response_length=0, context={},
                                             response_time=1000 * (time.perf_counter() - start),
                                             exception=RuntimeError(why))
