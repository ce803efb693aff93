"""A voice bench session's microphone (`omnirt bench realtime`): what it says, its noise floor, its turns, how it plays
the reply and thinks, over the WebSocket or as a WebRTC call."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from omnirt.app.audio.pcm import float_to_pcm16
from omnirt.app.audio.playback import PlaybackClock
from omnirt.app.audio.wire import PCM16

RATE = PCM16.sample_rate
CHUNK_S = 0.02
SILENCE_MS = 500  # the VAD's silence_duration_ms
TRANSCRIPTION = "conversation.item.input_audio_transcription"
FRAMES_PER_S = 12.5  # codec frames a second of reply speech


@dataclass(slots=True)
class Turn:
    session: int
    index: int
    speech_end: float  # perf_counter of the chunk that ended the speech
    speech_start: float = 0.0  # perf_counter of the utterance's first chunk
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
    played_until: float | None = None  # converse: perf_counter at which the reply finished playing
    think_s: float = 0.0  # the pause after it (after the turn's end in the diagnostic modes) before speaking again

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
    """The utterances sessions say in turn: the shipped set (`omnirt/loadtest/utterances.py`; at most
    `--max-utterance-s` long), the one of `utterance` (`--speech plain`), or (`--speech paused`) sentences with a
    600-900 ms pause mid-sentence (`omnirt/loadtest/speech.py`)."""
    if args.speech == "set" and not args.wav:
        from omnirt.loadtest.utterances import load

        return list(load(RATE, args.max_utterance_s))
    if args.speech in ("plain", "set"):
        return [utterance(args.wav)[0]]
    from omnirt.loadtest.speech import paused_speech

    return [audio for audio, _, _ in paused_speech(RATE)]


def wait_ms(args: argparse.Namespace) -> float:
    """The least silence after speech that the sessions' turn detection waits for before a turn may end."""
    if args.turn_detection == "server_vad":
        return SILENCE_MS
    from omnirt.app.audio.turn_end import SemanticVadConfig

    return SemanticVadConfig(eagerness=args.eagerness).candidate_pause_ms



def noise(rng: np.random.Generator, num_samples: int, db: float | None) -> np.ndarray:
    """A microphone's noise floor: white noise at `db` dBFS RMS (None: digital zero)."""
    if db is None:
        return np.zeros(num_samples, np.float32)
    return (rng.standard_normal(num_samples) * 10 ** (db / 20)).astype(np.float32)


def noise_db(text: str) -> float | None:
    return None if text == "off" else float(text)


def chunks(audio: np.ndarray, chunk_s: float = CHUNK_S) -> list[str]:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    step = int(RATE * chunk_s) * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


class Mic:
    """One microphone's turns: speech, then silence until the turn is over (its reply, or in `no-responses`
    mode `speech_stopped`); in converse mode until the reply has also played to its end at real time; then a
    think time. In converse mode a session that has done its measured turns goes on conversing, unmeasured,
    until the client stops it (when every session has done them: the load stays steady). A transport subclass
    sends the audio and feeds `on_event`."""

    def __init__(self, index: int, args: argparse.Namespace, result: ClientResult):
        self.index, self.args, self.result = index, args, result
        self.turn: Turn | None = None
        self.is_speaking, self._cut_ins = False, 0
        self.turn_over = asyncio.Event()
        self.on_measured = lambda: None  # called once the session's measured turns are done
        self._clock = PlaybackClock()  # the reply's playback, on the server's own clock (perf_counter)
        self._playback: dict | None = None  # the server's own playback report (WebRTC)
        self._played = asyncio.Event()  # WebRTC: the server's track stopped playing the reply
        self._think = random.Random(index)  # each session's own think times, the same in every run

    async def run(self, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        num_measured, t = self.args.warmup_turns + self.args.turns, 0
        while t < num_measured or self.args.mode == "converse":
            if t == num_measured:
                self.on_measured()
            await self._one_turn(t)
            t += 1
        self.on_measured()

    async def _one_turn(self, t: int) -> None:
        self.is_speaking, self._cut_ins = True, 0
        speech_start = time.perf_counter()
        speech_end = await self.speak(t)
        self.is_speaking = False
        self.turn = turn = Turn(self.index, t, speech_end, speech_start=speech_start,
                                     wait_ms=wait_ms(self.args), cut_ins=self._cut_ins)
        self.turn_over.clear()
        if not await self.silence_until(self.turn_over, self.args.turn_timeout):
            self.result.errors.append(f"session {self.index} turn {t}: no end within {self.args.turn_timeout:.0f} s")
        if self.args.mode == "converse":
            turn.played_until = await self.until_played()
        turn.think_s = self.think()
        self._finish_turn()
        await self.silence_until(None, turn.think_s)

    def think(self) -> float:
        """Seconds before the next utterance: uniform within `--think-s`, per session (seeded: the same every run).
        People answer after their own pause; a fixed one would keep sessions whose replies came together speaking
        together for the rest of the point, every turn a burst."""
        return self._think.uniform(*self.args.think_s)

    async def until_played(self) -> float:
        """Wait (the microphone going on) until the reply has played to its end; the perf_counter of that end."""
        raise NotImplementedError

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
                self._clock.on_packet(now, len(base64.b64decode(ev["delta"])) / 2 / RATE)
        elif kind == "output_audio_buffer.stopped":
            self._playback = ev.get("omnirt_playback")
            self._played.set()
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
        elif self._clock.num_packets:
            turn.audio_s, turn.underruns = self._clock.audio_s, self._clock.num_underruns
        self._clock, self._playback = PlaybackClock(), None
        if turn.index >= self.args.warmup_turns + self.args.turns:
            return  # conversing on while other sessions finish: load, not measured
        self.result.turns.append({**asdict(turn), "vad_lag_ms": turn.vad_lag_ms, "turn_end_ms": turn.turn_end_ms,
                                  "response_ms": turn.response_ms,
                                  "voice_to_voice_ms": turn.voice_to_voice_ms, "transcript_ms": turn.transcript_ms})


class WebSocketMic(Mic):
    """Paced 20 ms `input_audio_buffer.append` events; a reader task notes what comes back."""

    def __init__(self, ws, index: int, speech: list[np.ndarray], args: argparse.Namespace, result: ClientResult):
        super().__init__(index, args, result)
        self.ws, self.speech = ws, speech
        self._noise = np.random.default_rng(index)  # each session's own noise floor
        self._silences = chunks(noise(self._noise, RATE, noise_db(args.noise_db)))  # a second of it, in turn
        self._num_silent = 0
        self.clock = 0.0

    async def run(self, start_at: float) -> None:
        reader = asyncio.create_task(self._read())
        self.clock = start_at
        try:
            await super().run(start_at)
        finally:
            reader.cancel()

    async def speak(self, t: int) -> float:
        audio = self.speech[(self.index + t) % len(self.speech)]
        for chunk in chunks(audio + noise(self._noise, len(audio), noise_db(self.args.noise_db))):
            await self._send(chunk)
        return time.perf_counter()

    async def silence_until(self, event: asyncio.Event | None, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while event is None or not event.is_set():  # a microphone goes on sending its noise floor
            if time.perf_counter() >= deadline:
                return False
            self._num_silent += 1
            await self._send(self._silences[self._num_silent % len(self._silences)])
        return True

    async def until_played(self) -> float:
        end = max(self._clock.played_until, time.perf_counter()) if self._clock.num_packets else time.perf_counter()
        await self.silence_until(None, end - time.perf_counter())
        return end

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
    """The utterance goes out on the call's paced microphone track over the session's noise floor, and the floor
    flows whenever nothing is written; events come on the data channel; first audio is the server's
    `output_audio_buffer.started` (the reply's first frame left on its track), underruns are its track's own
    count."""

    def __init__(self, index: int, speech: list[np.ndarray], args: argparse.Namespace, result: ClientResult):
        super().__init__(index, args, result)
        self.speech, self.call = speech, None
        self._noise, self._noise_db = np.random.default_rng(index), noise_db(args.noise_db)  # as WebSocketMic's
        self._spoken: dict[str, float] = {}
        self._sent = asyncio.Event()
        self._handling: set[asyncio.Task] = set()

    async def connect(self, url: str) -> None:
        from omnirt.loadtest.webrtc_client import connect

        self.call = await connect(url, f"/v1/realtime?model={self.args.model}", on_event=self._channel_event,
                                  on_mic_event=self._mic_event, mic_fill=self._room)

    def _room(self, num_samples: int) -> np.ndarray:
        """The microphone's noise floor between utterances (48 kHz PCM16)."""
        return np.frombuffer(float_to_pcm16(noise(self._noise, num_samples, self._noise_db)), np.int16)

    async def speak(self, t: int) -> float:
        name = f"utterance-{t}"
        self._sent.clear()
        speech = self.speech[(self.index + t) % len(self.speech)]
        await self.call.mic.write(name, name, float_to_pcm16(speech + noise(self._noise, len(speech), self._noise_db)))
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

    async def until_played(self) -> float:
        """The server's track plays the reply at real time and says when it stopped."""
        if self.turn.first_audio is not None and self._playback is None:
            self._played.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._played.wait(), self.args.turn_timeout)
        return time.perf_counter()

    def _channel_event(self, ev: dict) -> None:
        task = asyncio.get_running_loop().create_task(self.on_event(ev, time.perf_counter()))
        self._handling.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._handling.discard)

    def _mic_event(self, ev: dict) -> None:
        if ev["type"] == "output_audio_buffer.stopped":  # the utterance's last frame went out
            self._spoken[ev["response_id"]] = time.perf_counter()
            self._sent.set()




def session_update(args: argparse.Namespace, index: int) -> dict:
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

