"""`omnirt bench realtime`: N concurrent voice sessions over the Realtime WebSocket, as microphones.

Each session streams a spoken utterance in real time in 20 ms PCM16 chunks with server VAD, keeps
sending silence between turns as a microphone does, and does T measured turns after a warm-up turn;
sessions start staggered. The sessions are spread over several client processes so that the client is
not the bottleneck (its own CPU is reported). Per session count N it reports p50/p90/p99 (nearest rank; where
the point has too few turns for a p90 or p99, the maximum, labelled so: `omnirt/loadtest/stats.py`) of

- VAD lag: end of speech (the last speech chunk sent) -> `speech_stopped`, less the silence the turn detection
  must wait for (server_vad: its 500 ms; semantic_vad: the pause at which it asks its end-of-turn model);
- turn end: the same, in full (what the speaker waits for), and false cut-ins (`speech_stopped` while the
  utterance is still being sent: a turn ended inside a mid-sentence pause of `--speech paused`);
- response latency: `speech_stopped` -> first audio delta;
- voice-to-voice: end of speech -> first audio delta;

plus underruns while playing the reply (full mode), turns that never got audio, `error` events, and
the API process's CPU per session (from its /metrics). Per turn of the conversation (the same utterance
each turn, so the history grows) it reports response latency and the prompt tokens of the turn's
response, those whose KV was reused (`cached_tokens` in `response.done`'s usage) and those prefilled; per
point the server's prefill token counters (`omnirt_stage_prefill_tokens`, computed vs cached, per stage) and
the engine's mean time from a request's submission to each stage's first output
(`omnirt_stage_first_output_seconds`: `omnirt/loadtest/server_metrics.py`). Modes: `cancel` (each reply is cancelled
at its first audio: turn latency alone), `full` (whole replies), `no-responses` (VAD only: the front end
alone). With `--transcription on` the sessions ask for transcripts of the user (`input_audio_transcription`),
a turn lasts until its transcript came too, and the point also reports the transcript latency
(`speech_stopped` -> `.completed`); `both` runs each point without, then with them, so that the reply's
latency compares in one run. `--turn-detection semantic_vad` (`--eagerness`) and `--noise-reduction` set the
sessions' front end. JSON, markdown and a plot per run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import queue
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.wire import PCM16
from omnirt.loadtest import plot, server_metrics
from omnirt.loadtest.bench import say_plan, server_args, server_platform, write_report
from omnirt.loadtest.chat_requests import underruns as _underruns
from omnirt.loadtest.local_server import serving
from omnirt.loadtest.stats import NOTE, cell, summary

RATE = PCM16.sample_rate
CHUNK_S = 0.02
SILENCE_MS = 500  # the VAD's silence_duration_ms
TRANSCRIPTION = "conversation.item.input_audio_transcription"


@dataclass(slots=True)
class Turn:
    session: int
    index: int
    speech_end: float  # perf_counter of the chunk that ended the speech
    wait_ms: float = SILENCE_MS  # the silence the turn detection waits for at least
    cut_ins: int = 0  # speech_stopped while the utterance was still being sent
    speech_stopped: float | None = None
    first_audio: float | None = None
    audio_s: float = 0.0
    underruns: int = 0
    status: str | None = None  # response.done status
    input_tokens: int | None = None  # response.done usage: the prompt
    cached_tokens: int | None = None  # of it, reused from a resident KV prefix
    transcript_at: float | None = None  # perf_counter of the user transcript's `.completed`
    transcript_failed: bool = False

    @property
    def vad_lag_ms(self) -> float | None:
        return None if self.turn_end_ms is None else self.turn_end_ms - self.wait_ms

    @property
    def turn_end_ms(self) -> float | None:
        return None if self.speech_stopped is None else (self.speech_stopped - self.speech_end) * 1000

    @property
    def response_ms(self) -> float | None:
        ok = self.first_audio is not None and self.speech_stopped is not None
        return (self.first_audio - self.speech_stopped) * 1000 if ok else None

    @property
    def voice_to_voice_ms(self) -> float | None:
        return None if self.first_audio is None else (self.first_audio - self.speech_end) * 1000

    @property
    def transcript_ms(self) -> float | None:
        ok = self.transcript_at is not None and self.speech_stopped is not None
        return (self.transcript_at - self.speech_stopped) * 1000 if ok else None


@dataclass(slots=True)
class ClientResult:
    turns: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


def utterance(wav: str | None, synthetic: bool = False) -> tuple[np.ndarray, float]:
    """(24 kHz float32 samples, seconds of speech in them): `wav`, else an espeak-ng phrase made now (or the
    synthetic signal, where espeak-ng is missing or `synthetic`)."""
    if wav:
        import soundfile
        import soxr

        audio, rate = soundfile.read(wav, dtype="float32")
        audio = audio if audio.ndim == 1 else audio.mean(1)
        audio = soxr.resample(audio, rate, RATE) if rate != RATE else audio
    else:
        from omnirt.loadtest.speech import speech

        audio = speech(RATE, synthetic)
    loud = np.flatnonzero(np.abs(audio) > 0.02)
    audio = audio[loud[0]:loud[-1] + 1] if loud.size else audio  # speech from its first to its last sample
    return audio.astype(np.float32), len(audio) / RATE


def utterances(args: argparse.Namespace) -> list[np.ndarray]:
    """The utterances sessions say in turn: the one of `utterance`, or (`--speech paused`) sentences with a
    600-900 ms pause mid-sentence (`omnirt/loadtest/speech.py`)."""
    if args.speech == "plain":
        return [utterance(args.wav)[0]]
    from omnirt.loadtest.speech import paused_speech

    return [audio for audio, _, _ in paused_speech(RATE)]


def wait_ms(args: argparse.Namespace) -> float:
    """The least silence after speech that the sessions' turn detection waits for before a turn may end."""
    if args.turn_detection == "server_vad":
        return SILENCE_MS
    from omnirt.app.audio.turn_end import SemanticVadConfig

    return SemanticVadConfig(eagerness=args.eagerness).candidate_pause_ms


def _chunks(audio: np.ndarray, chunk_s: float = CHUNK_S) -> list[str]:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    step = int(RATE * chunk_s) * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


class Mic:
    """One microphone's turns: speech, then silence until the turn is over (its reply, or in `no-responses`
    mode `speech_stopped`), then a gap; a transport subclass sends the audio and feeds `on_event`."""

    def __init__(self, index: int, args: argparse.Namespace, result: ClientResult):
        self.index, self.args, self.result = index, args, result
        self.turn: Turn | None = None
        self.is_speaking, self._cut_ins = False, 0
        self.turn_over = asyncio.Event()
        self._arrivals: list[tuple[float, float]] = []  # (arrival, seconds of audio) per delta
        self._playback: dict | None = None  # the server's own playback report (WebRTC)
        self._gaps = random.Random(index)  # each session's own gaps, the same in every run

    async def run(self, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        for t in range(self.args.warmup_turns + self.args.turns):
            self.is_speaking, self._cut_ins = True, 0
            speech_end = await self.speak(t)
            self.is_speaking = False
            self.turn = Turn(self.index, t, speech_end, wait_ms(self.args), self._cut_ins)
            self.turn_over.clear()
            if not await self.silence_until(self.turn_over, self.args.turn_timeout):
                self.result.errors.append(f"session {self.index} turn {t}: no end within "
                                          f"{self.args.turn_timeout:.0f} s")
            self._finish_turn()
            await self.silence_until(None, self.gap())

    def gap(self) -> float:
        """Seconds of silence before the next utterance: `--gap`, give or take `--gap-jitter` (uniform). People
        answer after their own pause; a fixed one would keep sessions whose replies came together speaking
        together for the rest of the point, every turn a burst."""
        return max(0.0, self.args.gap + self._gaps.uniform(-self.args.gap_jitter, self.args.gap_jitter))

    async def speak(self, t: int) -> float:
        """Send the utterance in real time; the perf_counter at which its last sample went out."""
        raise NotImplementedError

    async def silence_until(self, event: asyncio.Event | None, timeout: float) -> bool:
        """Send silence until `event` is set (True) or `timeout` seconds passed (False)."""
        raise NotImplementedError

    async def cancel(self) -> None:
        raise NotImplementedError

    async def on_event(self, ev: dict, now: float) -> None:
        kind, turn = ev["type"], self.turn
        if kind == "error":
            self.result.errors.append(f"session {self.index}: {ev['error'].get('message')}")
        if kind == "input_audio_buffer.speech_stopped" and self.is_speaking:
            self._cut_ins += 1
        if turn is None:
            return
        if kind == "input_audio_buffer.speech_stopped" and turn.speech_stopped is None:
            turn.speech_stopped = now
            if self.args.mode == "no-responses":
                turn.status = "none"
                self._may_end_turn()
        elif kind in ("response.output_audio.delta", "response.audio.delta", "output_audio_buffer.started"):
            if turn.first_audio is None:  # a delta (WebSocket), or the first frame sent on the track (WebRTC)
                turn.first_audio = now
                if self.args.mode == "cancel":
                    await self.cancel()
            if "delta" in ev:
                self._arrivals.append((now, len(base64.b64decode(ev["delta"])) / 2 / RATE))
        elif kind == "output_audio_buffer.stopped":
            self._playback = ev.get("omnirt_playback")
        elif kind == "response.done":
            turn.status = ev["response"]["status"]
            usage = ev["response"].get("usage") or {}
            turn.input_tokens = usage.get("input_tokens")
            turn.cached_tokens = (usage.get("input_token_details") or {}).get("cached_tokens")
            self._may_end_turn()
        elif kind == f"{TRANSCRIPTION}.completed":
            turn.transcript_at = now
            self._may_end_turn()
        elif kind == f"{TRANSCRIPTION}.failed":
            turn.transcript_failed = True
            self.result.errors.append(f"session {self.index}: transcription failed: {ev['error'].get('message')}")
            self._may_end_turn()

    def _may_end_turn(self) -> None:
        """A turn is over once its reply is (or its speech stopped, without replies) and, when the session
        asks for transcripts, its transcript came."""
        turn = self.turn
        if turn.status is not None and (not self.args.transcribe or turn.transcript_at or turn.transcript_failed):
            self.turn_over.set()

    def _finish_turn(self) -> None:
        turn, self.turn = self.turn, None
        if self._playback is not None:  # WebRTC: the server's track counted what it played
            turn.audio_s, turn.underruns = self._playback["audio_ms"] / 1000, self._playback["num_underruns"]
        elif self._arrivals:
            turn.audio_s = sum(d for _, d in self._arrivals)
            turn.underruns = _underruns([(t - self._arrivals[0][0], d) for t, d in self._arrivals])
        self._arrivals, self._playback = [], None
        self.result.turns.append({**asdict(turn), "vad_lag_ms": turn.vad_lag_ms, "turn_end_ms": turn.turn_end_ms,
                                  "response_ms": turn.response_ms,
                                  "voice_to_voice_ms": turn.voice_to_voice_ms, "transcript_ms": turn.transcript_ms})


class WebSocketMic(Mic):
    """Paced 20 ms `input_audio_buffer.append` events; a reader task notes what comes back."""

    def __init__(self, ws, index: int, speech: list[list[str]], args: argparse.Namespace, result: ClientResult):
        super().__init__(index, args, result)
        self.ws, self.speech = ws, speech
        self.silence = _chunks(np.zeros(int(RATE * CHUNK_S), np.float32))[0]
        self.clock = 0.0

    async def run(self, start_at: float) -> None:
        reader = asyncio.create_task(self._read())
        self.clock = start_at
        try:
            await super().run(start_at)
        finally:
            reader.cancel()

    async def speak(self, t: int) -> float:
        for chunk in self.speech[(self.index + t) % len(self.speech)]:
            await self._send(chunk)
        return time.perf_counter()

    async def silence_until(self, event: asyncio.Event | None, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while event is None or not event.is_set():  # a microphone goes on sending silence
            if time.perf_counter() >= deadline:
                return False
            await self._send(self.silence)
        return True

    async def cancel(self) -> None:
        await self.ws.send(json.dumps({"type": "response.cancel"}))

    async def _send(self, chunk: str) -> None:
        """Paced on an absolute schedule, so that a late chunk does not push all later ones."""
        await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        self.clock += CHUNK_S
        await asyncio.sleep(max(0.0, self.clock - time.perf_counter()))

    async def _read(self) -> None:
        async for raw in self.ws:
            await self.on_event(json.loads(raw), time.perf_counter())


class WebRtcMic(Mic):
    """The utterance goes out on the call's paced microphone track (silence flows whenever nothing is
    written); events come on the data channel; first audio is the server's `output_audio_buffer.started`
    (the reply's first frame left on its track), underruns are its track's own count."""

    def __init__(self, index: int, pcm16: list[bytes], args: argparse.Namespace, result: ClientResult):
        super().__init__(index, args, result)
        self.pcm16, self.call = pcm16, None
        self._spoken: dict[str, float] = {}
        self._sent = asyncio.Event()
        self._handling: set[asyncio.Task] = set()

    async def connect(self, url: str) -> None:
        from omnirt.loadtest.webrtc_client import connect

        self.call = await connect(url, f"/v1/realtime?model={self.args.model}", on_event=self._channel_event,
                                  on_mic_event=self._mic_event)

    async def speak(self, t: int) -> float:
        name = f"utterance-{t}"
        self._sent.clear()
        await self.call.mic.write(name, name, self.pcm16[(self.index + t) % len(self.pcm16)])
        self.call.mic.response_done(name)
        await self._sent.wait()
        return self._spoken.pop(name)

    async def silence_until(self, event: asyncio.Event | None, timeout: float) -> bool:
        if event is None:
            await asyncio.sleep(timeout)
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def cancel(self) -> None:
        self.call.send({"type": "response.cancel"})

    def _channel_event(self, ev: dict) -> None:
        task = asyncio.get_running_loop().create_task(self.on_event(ev, time.perf_counter()))
        self._handling.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._handling.discard)

    def _mic_event(self, ev: dict) -> None:
        if ev["type"] == "output_audio_buffer.stopped":  # the utterance's last frame went out
            self._spoken[ev["response_id"]] = time.perf_counter()
            self._sent.set()


def _session_update(args: argparse.Namespace, index: int) -> dict:
    """Session `index`'s settings. Its instructions are its own: sessions say the same utterance every turn,
    and would otherwise share their whole history (a prefix cache would serve one session's turns from
    another's)."""
    return {"type": "session.update", "session": {
        "instructions": f"You are voice assistant number {index}. Be brief.",
        "turn_detection": {**({"type": "server_vad", "silence_duration_ms": SILENCE_MS}
                              if args.turn_detection == "server_vad" else
                              {"type": "semantic_vad", "eagerness": args.eagerness}),
                           "create_response": args.mode != "no-responses"},
        "input_audio_noise_reduction": None if args.noise_reduction == "off" else {"type": args.noise_reduction},
        "input_audio_format": "pcm16", "output_audio_format": "pcm16", "voice": args.voice,
        "modalities": ["text", "audio"],
        "input_audio_transcription": {"model": args.model} if args.transcribe else None,
        **({"max_response_output_tokens": args.reply_tokens} if args.reply_tokens else {}),
        **({"talker_sampling": {"max_tokens": args.reply_frames}} if args.reply_frames else {})}}


async def _client(index: int, sessions: list[int], args: argparse.Namespace, start_at: float) -> ClientResult:
    import websockets

    result = ClientResult()
    audios = utterances(args)
    speech, pcm16 = [_chunks(a) for a in audios], [float_to_pcm16(a) for a in audios]
    url = args.url.replace("http", "ws", 1) + f"/v1/realtime?model={args.model}"

    async def over_websocket(i: int) -> None:
        async with websockets.connect(url, max_size=None, open_timeout=60,
                                      additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            json.loads(await ws.recv())  # session.created
            await ws.send(json.dumps(_session_update(args, i)))
            await WebSocketMic(ws, i, speech, args, result).run(start_at + i * args.stagger)

    async def over_webrtc(i: int) -> None:
        mic = WebRtcMic(i, pcm16, args, result)
        await mic.connect(args.url)
        try:
            await mic.call.wait_for(lambda e: e["type"] == "session.created", 60)
            mic.call.send(_session_update(args, i))
            await mic.run(start_at + i * args.stagger)
        finally:
            await mic.call.close()

    async def one(i: int) -> None:
        try:
            await (over_webrtc if args.transport == "webrtc" else over_websocket)(i)
        except Exception as exc:  # a refused or dropped session is a result, not a crash
            result.errors.append(f"session {i}: {type(exc).__name__}: {exc}")

    await asyncio.gather(*(one(i) for i in sessions))
    result.cpu_s = time.process_time()
    return result


def _client_main(index: int, sessions: list[int], args: argparse.Namespace, start_at: float, outbox) -> None:
    outbox.put(asdict(asyncio.run(_client(index, sessions, args, start_at))))


# ---- abusive sessions (--abusive N) --------------------------------------------------------------------

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
            await ws.send(json.dumps(_session_update(args, -1)))
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


def _abusers_main(n: int, args: argparse.Namespace, stop, outbox) -> None:
    """N abusive sessions, each going through the kinds in turn (a new connection each time) until `stop`."""

    async def run() -> list[dict]:
        speech, done, records = _chunks(utterance(args.wav)[0], FLOOD_CHUNK_S), asyncio.Event(), []
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


def run_point(args: argparse.Namespace, n: int, abusive: int = 0, transcribe: bool = False) -> dict:
    """N sessions spread over the client processes (and `abusive` abusers in a process of their own, from
    before the first session starts until the last one ends), asking for transcripts or not; the row."""
    args = argparse.Namespace(**{**vars(args), "transcribe": transcribe})
    clients = max(1, min(args.clients, n))
    ctx = multiprocessing.get_context("spawn")
    inbox, abuse_box, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    abusers = ctx.Process(target=_abusers_main, args=(abusive, args, stop, abuse_box)) if abusive else None
    if abusers is not None:
        abusers.start()
    before, t0 = server_metrics.settled_scrape(args.url), time.time()
    start_at = time.perf_counter() + 3.0  # perf_counter is one clock for every process of this host
    procs = [ctx.Process(target=_client_main, args=(c, list(range(c, n, clients)), args, start_at, inbox))
             for c in range(clients)]
    for p in procs:
        p.start()
    results = _gather(procs, inbox)
    wall, cpu1 = time.time() - t0, server_metrics.cpu_seconds(server_metrics.scrape(args.url))
    cpu0, after = server_metrics.cpu_seconds(before), server_metrics.settled_scrape(args.url)
    stop.set()
    records = _gather([abusers], abuse_box)[0] if abusers is not None else []
    turns = [t for r in results for t in r["turns"] if t["index"] >= args.warmup_turns]  # warm-up turns not counted
    row = summarize(n, turns, [e for r in results for e in r["errors"]], args,
                    server_cpu=(cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else None,
                    client_cpu=sum(r["cpu_s"] for r in results) / wall)
    return {**row, "abusive": abusive, "abuse": _abuse_summary(records),
            "prefill_tokens": server_metrics.delta(server_metrics.prefill_tokens(after),
                                                   server_metrics.prefill_tokens(before)),
            "first_output_ms": server_metrics.first_output_ms(server_metrics.first_outputs(after),
                                                              server_metrics.first_outputs(before)),
            "engine": server_metrics.engine_counters(after, before)}


def _abuse_summary(records: list[dict]) -> dict:
    """Per abuse kind: connections, how the server closed them, and the error codes it sent."""
    out: dict[str, dict] = {}
    for r in records:
        k = out.setdefault(r["kind"], {"connections": 0, "closes": Counter(), "errors": Counter()})
        k["connections"] += 1
        k["closes"][f"{r['close_code']} {r['close_reason'] or ''}".strip()] += 1
        k["errors"].update(str(e) for e in r["errors"])
    return {kind: {**v, "closes": dict(v["closes"]), "errors": dict(v["errors"])} for kind, v in out.items()}


def _gather(procs: list, inbox) -> list[dict]:
    """Every client's result; a client process that died without one is an error, not a hang."""
    results: list[dict] = []
    while len(results) < len(procs):
        try:
            results.append(inbox.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a client process failed (exit code {dead[0].exitcode})") from None
    for p in procs:
        p.join()
    return results


def summarize(n: int, turns: list[dict], errors: list[str], args: argparse.Namespace, server_cpu: float | None,
              client_cpu: float) -> dict:
    wants_audio = args.mode != "no-responses"
    return {"sessions": n, "mode": args.mode, "transcription": args.transcribe, "turns": len(turns),
            "expected_turns": n * args.turns, "front_end": front_end(args),
            "vad_lag_ms": summary([t["vad_lag_ms"] for t in turns]),
            "turn_end_ms": summary([t["turn_end_ms"] for t in turns]),
            "cut_ins": sum(t["cut_ins"] for t in turns), "turns_cut": sum(t["cut_ins"] > 0 for t in turns),
            "response_ms": summary([t["response_ms"] for t in turns]),
            "voice_to_voice_ms": summary([t["voice_to_voice_ms"] for t in turns]),
            "transcript_ms": summary([t["transcript_ms"] for t in turns]),
            "transcripts_failed": sum(t["transcript_failed"] for t in turns),
            "turns_without_audio": sum(t["first_audio"] is None for t in turns) if wants_audio else 0,
            "turns_without_speech_stopped": sum(t["speech_stopped"] is None for t in turns),
            "underruns": sum(t["underruns"] for t in turns) if args.mode == "full" else None,
            "reply_audio_s": summary([t["audio_s"] for t in turns]) if args.mode == "full" else None,
            "errors": len(errors), "error_samples": errors[:5],
            "server_cpu_per_session": server_cpu / n if server_cpu is not None else None,
            "client_cpu": client_cpu, "by_turn": _by_turn(turns)}


def front_end(args: argparse.Namespace) -> str:
    """The sessions' turn detection, noise reduction and speech, as the report names them."""
    td = "server_vad" if args.turn_detection == "server_vad" else f"semantic_vad ({args.eagerness})"
    noise = "" if args.noise_reduction == "off" else f", {args.noise_reduction}"
    return f"{td}{noise}{', paused speech' if args.speech == 'paused' else ''}"


def _mean(values: list) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _by_turn(turns: list[dict]) -> list[dict]:
    """Per turn of the conversation (1-based, warm-up turns counted): latency percentiles over the
    sessions, and the mean prompt, reused and prefilled tokens of the turn's response."""
    rows = []
    for index in sorted({t["index"] for t in turns}):
        at = [t for t in turns if t["index"] == index]
        prompt, cached = _mean([t["input_tokens"] for t in at]), _mean([t["cached_tokens"] for t in at])
        rows.append({"turn": index + 1, "vad_lag_ms": summary([t["vad_lag_ms"] for t in at]),
                     "response_ms": summary([t["response_ms"] for t in at]),
                     "voice_to_voice_ms": summary([t["voice_to_voice_ms"] for t in at]), "input_tokens": prompt,
                     "cached_tokens": cached,
                     "prefilled_tokens": None if prompt is None or cached is None else prompt - cached})
    return rows


def markdown(rows: list[dict], title: str) -> str:
    head = ("| sessions | abusive | mode | front end | transcripts | turns | VAD lag ms p50/p90/p99 | turn end ms "
            "p50/p90/p99 | false cut-ins (turns) | response ms p50/p90/p99 | voice-to-voice ms p50/p90/p99 | "
            "transcript ms p50/p90/p99 | no audio | underruns | errors | server CPU per session | client CPU |\n|"
            + "---|" * 17 + "\n")
    abuse = "".join(f"\n- {r['sessions']} sessions, {r['abusive']} abusive: {kind}: {a['connections']} connections, "
                    f"closed {a['closes']}, errors {a['errors']}" for r in rows for kind, a in r["abuse"].items())
    return (f"### {title}\n\n{head}" + "".join(_row(r) for r in rows) + abuse + "\n" + _turns_markdown(rows)
            + f"\n{NOTE}\n")


def _turns_markdown(rows: list[dict]) -> str:
    """Per session count, a row per turn; and the server's prefill counters over the point."""
    rows = [r for r in rows if r.get("by_turn") and r["mode"] != "no-responses"]
    if not rows:
        return ""
    num = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    out = ["\n| turn | sessions | response ms p50 / p90 | voice-to-voice ms p50 | prompt tokens | reused | "
           "prefilled |\n|---|---|---|---|---|---|---|\n"]
    for r in rows:
        out += [f"| turn {t['turn']} | {r['sessions']} | {cell(t['response_ms'], ('p50', 'p90'))} | "
                f"{cell(t['voice_to_voice_ms'], ('p50',))} | {num(t['input_tokens'])} | "
                f"{num(t['cached_tokens'])} | {num(t['prefilled_tokens'])} |\n" for t in r["by_turn"]]
    out += [f"\n- {r['sessions']} sessions, server prompt tokens over the point: "
            + "; ".join(f"{stage} {c.get('computed', 0):.0f} computed, {c.get('cached', 0):.0f} reused"
                        for stage, c in r.get("prefill_tokens", {}).items())
            + f"; engine, submission to each stage's first output, mean ms: "
              f"{server_metrics.first_output_cell(r.get('first_output_ms', {}))}; engine steps over the point: "
              f"{server_metrics.engine_cell(r.get('engine', {}))}" for r in rows]
    return "".join(out) + "\n"


def _row(r: dict) -> str:
    server_cpu = "-" if r["server_cpu_per_session"] is None else f"{r['server_cpu_per_session']:.3f}"
    underruns = "-" if r["underruns"] is None else r["underruns"]
    transcripts = f"on ({r['transcripts_failed']} failed)" if r.get("transcription") else "off"
    cut = f"{r['cut_ins']} ({r['turns_cut']})" if "cut_ins" in r else "-"
    return (f"| {r['sessions']} | {r['abusive']} | {r['mode']} | {r.get('front_end', 'server_vad')} | {transcripts} | "
            f"{r['turns']}/{r['expected_turns']} | {cell(r['vad_lag_ms'])} | "
            f"{cell(r['turn_end_ms']) if 'turn_end_ms' in r else '-'} | {cut} | {cell(r['response_ms'])} | "
            f"{cell(r['voice_to_voice_ms'])} | "
            f"{cell(r['transcript_ms']) if 'transcript_ms' in r else '-'} | "
            f"{r['turns_without_audio']} | {underruns} | {r['errors']} | {server_cpu} | {r['client_cpu']:.2f} |\n")


SESSIONS = {"cpu": [1, 4], "gpu": [1, 8, 16]}  # session counts when none are given


def build_parser() -> argparse.ArgumentParser:
    from omnirt.app.flags import HelpFormatter

    p = argparse.ArgumentParser(prog="omnirt bench realtime", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    server_args(p)
    p.add_argument("--sessions", type=int, nargs="+", default=None, help="session counts to run, in turn (default: "
                   f"{' '.join(map(str, SESSIONS['gpu']))} on an accelerator, {' '.join(map(str, SESSIONS['cpu']))} "
                   "on a CPU server)")
    p.add_argument("--turns", type=int, default=3, help="turns per session that are measured")
    p.add_argument("--warmup-turns", type=int, default=1, help="turns per session before those, not counted "
                   "(a fresh server's first turns pay for one-time work)")
    p.add_argument("--mode", choices=("cancel", "full", "no-responses"), default="cancel",
                   help="cancel: each reply is cancelled at its first audio; full: whole replies; no-responses: "
                        "the VAD alone")
    p.add_argument("--reply-tokens", type=int, help="each reply's text at most this many tokens "
                   "(max_response_output_tokens; default: the server's limit)")
    p.add_argument("--reply-frames", type=int, help="each reply's speech at most this many codec frames (omnirt's "
                   "session talker_sampling; 12.5 a second): with random weights a reply rarely ends by itself")
    p.add_argument("--transport", choices=("websocket", "webrtc"), default="websocket",
                   help="webrtc: each session is an aiortc call whose microphone track carries the speech")
    p.add_argument("--clients", type=int, default=4, help="client processes the sessions are spread over")
    p.add_argument("--stagger", type=float, default=0.1, help="seconds between session starts")
    p.add_argument("--gap", type=float, default=1.0, help="mean seconds of silence between a turn's end (its "
                   "response.done) and the next utterance")
    p.add_argument("--gap-jitter", type=float, default=0.5, help="each gap drawn uniformly within --gap +- this, "
                   "per session (seeded: the same every run); 0: every gap --gap, and sessions whose turns ended "
                   "together stay in step")
    p.add_argument("--wav", help="the utterance (any rate, mono or not) (default: an espeak-ng phrase)")
    p.add_argument("--speech", choices=("plain", "paused"), default="plain", help="paused: sentences with a 600-900 "
                   "ms pause mid-sentence (espeak-ng), for turn end and false cut-ins; plain: the one utterance")
    p.add_argument("--turn-detection", choices=("server_vad", "semantic_vad"), default="server_vad",
                   help=f"the sessions' turn detection (server_vad: {SILENCE_MS} ms of silence ends a turn)")
    p.add_argument("--eagerness", choices=("low", "medium", "high", "auto"), default="auto",
                   help="semantic_vad's eagerness")
    p.add_argument("--noise-reduction", choices=("off", "near_field", "far_field"), default="off",
                   help="the sessions' input noise reduction (RNNoise)")
    p.add_argument("--turn-timeout", type=float, default=120.0, help="seconds a turn may take")
    p.add_argument("--abusive", type=int, default=0, help="also run each point with this many abusive sessions "
                   "beside the normal ones (flooding audio, malformed events, not reading), after the same point "
                   "without them")
    p.add_argument("--deaf-s", type=float, default=60.0, help="how long an abusive session reads nothing (long "
                   "enough for the kernel's socket buffers to fill)")
    p.add_argument("--transcription", choices=("off", "on", "both"), default="off",
                   help="on: the sessions ask for transcripts of the user (input_audio_transcription); both: each "
                        "point without, then with them")
    p.add_argument("--name", default="realtime", help="the report's name")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with serving(args):
        run_sessions(args)


def run_sessions(args: argparse.Namespace) -> None:
    platform = server_platform(args.url)
    args.sessions = args.sessions or SESSIONS["cpu" if platform == "cpu" else "gpu"]
    say_plan(args, f"{platform} server at {args.url}: {args.sessions} {args.transport} sessions x "
             f"({args.warmup_turns} + {args.turns}) turns, mode {args.mode}, {front_end(args)}, transcripts "
             f"{args.transcription}"
             f"{f', each point again beside {args.abusive} abusive' if args.abusive else ''} (--sessions to change)")
    rows = []
    transcribing = {"off": (False,), "on": (True,), "both": (False, True)}[args.transcription]
    for n in args.sessions:
        for abusive in sorted({0, args.abusive}):
            for transcribe in transcribing:
                rows.append(run_point(args, n, abusive, transcribe))
                print(markdown(rows[-1:], f"{args.name}: {n} sessions, {abusive} abusive, transcripts "
                                          f"{'on' if transcribe else 'off'}"), flush=True)
    write_report(args, rows, markdown, plot.voice)


if __name__ == "__main__":
    main()
