"""Transcripts of the user (`audio.input.transcription` / `input_audio_transcription`): the settings of both
generations, and the session layer driven in-process over the tiny engine: the events and their order,
the transcript in the item, the start after the reply's first audio, barge-in, deleting the item, a
failure mid-way (`.failed`), and closing the session mid-transcription (nothing leaks, nothing after).
Transcription sessions (`type: "transcription"`, beta `transcription_session.update`): their settings, their
events, and no response ever (over a WebSocket: tests/test_realtime_protocol.py; pipecat's client:
tests/test_framework_pipecat_stt.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from omnirt.app.audio.vad import VadBatcher
from omnirt.app.realtime.config import SessionConfig, apply_session_update, initial_config, session_object
from omnirt.app.realtime.events import ProtocolError
from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession
from omnirt.app.realtime.transcription import INSTRUCTION, MAX_PENDING, TranscriptionConfig, transcription_messages
from omnirt.app.realtime.transcription_session import apply_update, as_transcription, session_event
from tests.conftest import until

VOICES = ("chelsie", "ethan")
EVENT = "conversation.item.input_audio_transcription"
GA_ON = {"audio": {"input": {"transcription": {"model": "tiny"}}}, "max_output_tokens": 16}
LONG_AUDIO = {"max_output_tokens": 30, "talker_sampling": {"min_tokens": 2000, "max_tokens": 2000}}


def test_transcription_settings_of_both_generations():
    cfg = SessionConfig(model="tiny", voice="ethan")
    ga = apply_session_update(cfg, {"audio": {"input": {"transcription": {"model": "whisper-1", "language": "en",
                                                                           "prompt": "omnirt, Qwen"}}}}, VOICES)
    assert ga.transcription == TranscriptionConfig("whisper-1", "en", "omnirt, Qwen")
    beta = apply_session_update(cfg, {"input_audio_transcription": {}}, VOICES)
    assert beta.transcription == TranscriptionConfig("tiny")  # the session's model when none is named
    assert session_object(ga, "s", beta=False)["audio"]["input"]["transcription"] == {
        "model": "whisper-1", "language": "en", "prompt": "omnirt, Qwen"}
    echoed = session_object(beta, "s", beta=True)
    assert echoed["input_audio_transcription"] == {"model": "tiny", "language": None, "prompt": None}
    assert apply_session_update(beta, {k: v for k, v in echoed.items() if k != "object"}, VOICES) == beta  # sent back
    assert apply_session_update(ga, {"audio": {"input": {"transcription": None}}}, VOICES).transcription is None
    assert apply_session_update(ga, {"instructions": "x"}, VOICES).transcription == ga.transcription  # kept
    for bad, param, code in [
            ({"input_audio_transcription": {"model": "whisper-2"}}, "session.input_audio_transcription.model",
             "invalid_value"),
            ({"audio": {"input": {"transcription": {"model": 7}}}}, "session.audio.input.transcription.model",
             "invalid_type"),
            ({"audio": {"input": {"transcription": "whisper-1"}}}, "session.audio.input.transcription",
             "invalid_type"),
            ({"input_audio_transcription": {"language": "English"}}, "session.input_audio_transcription.language",
             "invalid_value"),
            ({"input_audio_transcription": {"prompt": "x" * 2001}}, "session.input_audio_transcription.prompt",
             "invalid_value"),
            ({"input_audio_transcription": {"delay": "low"}}, "session.input_audio_transcription.delay",
             "unsupported_parameter"),
            ({"input_audio_transcription": {"bogus": 1}}, "session.input_audio_transcription.bogus",
             "unknown_parameter")]:
        with pytest.raises(ProtocolError) as err:
            apply_session_update(cfg, bad, VOICES)
        assert (err.value.param, err.value.code) == (param, code)


def test_the_prompt_is_a_plain_message_list():
    audio = np.zeros(1600, np.float32)
    system, user = transcription_messages(audio, TranscriptionConfig("tiny", "fr", "a cooking show"))
    assert system["role"] == "system" and system["content"].startswith(INSTRUCTION)
    assert "'fr'" in system["content"] and system["content"].endswith("Context: a cooking show")
    assert user["role"] == "user" and user["content"][0]["type"] == "audio" and user["content"][0]["audio"] is audio


class Recorder:
    """A session over the in-process engine whose events are all kept; `submits` notes, for each engine
    request, whether the session's response had sent its first audio when it was submitted."""

    def __init__(self, engine, session_update: dict | None, beta: bool = False, config: SessionConfig | None = None):
        self.engine, self.events, self.submits, self.aborted, self.update = engine, [], [], [], session_update
        self.session = RealtimeSession(self, config or initial_config(engine.info(), "tiny", ""), RealtimeLimits(),
                                       VadBatcher(), beta=beta)

    def info(self):
        return self.engine.info()

    def abort(self, request_id: str, error: str | None = None) -> None:
        self.aborted.append(request_id)
        self.engine.abort(request_id, error)

    def submit(self, req):
        reply = self.session.response
        self.submits.append((req.request_id, None if reply is None else reply.has_output))
        return self.engine.submit(req)

    async def __aenter__(self):
        await self.session.start()
        self.reader = asyncio.create_task(self._drain())
        if self.update is not None:
            await self.send({"type": "session.update", "session": self.update})
        return self

    async def __aexit__(self, *exc):
        await self.session.close()
        await self.reader

    async def _drain(self):
        while (ev := await self.session.outbox.get()) is not None:
            self.events.append(ev)

    async def send(self, event: dict) -> None:
        await self.session.handle_event(event)

    async def speak(self, samples: np.ndarray) -> None:
        for i in range(0, len(samples), 2400):  # 100 ms at 24 kHz
            await self.session.append_audio(samples[i:i + 2400], 24000)

    async def until(self, predicate, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout  # a guard against a hang, not a bound
        while not predicate(self.events):
            assert time.monotonic() < deadline, [e["type"] for e in self.events][-10:]
            await asyncio.sleep(0.05)

    def of(self, kind: str, item_id: str | None = None) -> list[dict]:
        return [e for e in self.events if e["type"] == kind and item_id in (None, e.get("item_id"))]


def _types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def _ended(item_id: str):
    return lambda events: any(e["type"] in (f"{EVENT}.completed", f"{EVENT}.failed") and e["item_id"] == item_id
                              for e in events)


async def test_a_vad_turn_is_transcribed_after_the_replys_first_audio(engine, speech):
    """Server VAD: the user item, then the reply; the transcription is submitted only once the reply sent
    its first audio; its deltas add up to `.completed`'s transcript, which the item then holds."""
    async with Recorder(engine, GA_ON) as rec:
        await rec.speak(speech)
        committed = (await _wait(rec, "input_audio_buffer.committed"))["item_id"]
        await rec.until(lambda ev: _ended(committed)(ev) and "response.done" in _types(ev))
        await rec.send({"type": "conversation.item.retrieve", "item_id": committed})
        await rec.until(lambda ev: "conversation.item.retrieved" in _types(ev))
    kinds = _types(rec.events)
    (transcription_id, had_output), = [s for s in rec.submits if s[0].startswith("transcription")]
    assert had_output is True and rec.submits[0][0].startswith("resp")  # the reply went first, and sent audio
    deltas, (done,) = rec.of(f"{EVENT}.delta", committed), rec.of(f"{EVENT}.completed", committed)
    assert deltas and "".join(d["delta"] for d in deltas) == done["transcript"] and done["transcript"]
    assert all(d["content_index"] == 0 for d in deltas) and done["content_index"] == 0
    assert kinds.index("conversation.item.done") < kinds.index(f"{EVENT}.delta")
    assert kinds.index("response.output_audio.delta") < kinds.index(f"{EVENT}.delta")
    usage = done["usage"]
    assert usage["type"] == "tokens" and usage["output_tokens"] >= len(deltas) and usage["input_tokens"] > 10
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    retrieved = rec.of("conversation.item.retrieved")[0]["item"]
    assert retrieved["content"] == [{"type": "input_audio", "transcript": done["transcript"]}]
    assert not rec.of("error") and engine.num_active_requests == 0


async def test_transcription_survives_barge_in_and_keeps_turn_order(engine, speech):
    """The user talks over a long reply: the reply is cancelled, and both turns' transcripts complete, in
    the order of the turns."""
    update = {"audio": {"input": {"transcription": {"model": "tiny"},
                                  "turn_detection": {"type": "server_vad", "create_response": False}}}}
    async with Recorder(engine, update) as rec:
        await rec.speak(speech)
        first = (await _wait(rec, "input_audio_buffer.committed"))["item_id"]
        await rec.send({"type": "response.create", "response": LONG_AUDIO})
        await rec.until(lambda ev: "response.output_audio.delta" in _types(ev))
        await rec.speak(speech)  # barge-in
        await rec.until(lambda ev: len([e for e in ev if e["type"] == "input_audio_buffer.committed"]) == 2)
        second = rec.of("input_audio_buffer.committed")[1]["item_id"]
        await rec.until(lambda ev: _ended(first)(ev) and _ended(second)(ev) and "response.done" in _types(ev))
    done = [e for e in rec.events if e["type"] == f"{EVENT}.completed"]
    assert [e["item_id"] for e in done] == [first, second] and all(e["transcript"] for e in done)
    cancelled = rec.of("response.done")[0]["response"]["status_details"]
    assert cancelled == {"type": "cancelled", "reason": "turn_detected"}
    assert not rec.of(f"{EVENT}.failed") and engine.num_active_requests == 0


async def _wait(rec: Recorder, kind: str) -> dict:
    await rec.until(lambda ev: kind in _types(ev))
    return rec.of(kind)[0]


MANUAL = {"audio": {"input": {"transcription": {"model": "tiny"}, "turn_detection": None}}}


async def _commit(rec: Recorder, samples: np.ndarray) -> str:
    num_commits = len(rec.of("input_audio_buffer.committed"))
    await rec.speak(samples)
    await rec.send({"type": "input_audio_buffer.commit"})
    await rec.until(lambda ev: len(rec.of("input_audio_buffer.committed")) > num_commits)
    return rec.of("input_audio_buffer.committed")[-1]["item_id"]


async def test_a_failure_mid_way_is_a_failed_event_and_the_session_goes_on(engine, speech):
    """The engine ends the transcription with an error after its first delta: `.failed` in OpenAI's shape,
    the item keeps no transcript, and the next turn is transcribed."""
    async with Recorder(engine, MANUAL) as rec:
        item = await _commit(rec, speech)
        await rec.until(lambda ev: rec.of(f"{EVENT}.delta", item))
        engine.abort(rec.submits[-1][0], "the server is shutting down")
        await rec.until(_ended(item))
        again = await _commit(rec, speech)
        await rec.until(_ended(again))
    (failed,) = rec.of(f"{EVENT}.failed", item)
    assert failed["content_index"] == 0 and failed["error"] == {
        "type": "server_error", "code": "transcription_failed", "message": "the server is shutting down", "param": None}
    assert not rec.of(f"{EVENT}.completed", item) and rec.of(f"{EVENT}.completed", again)
    assert rec.session.conversation.get(item).content[0].transcript is None
    assert engine.num_active_requests == 0


async def test_deleting_the_item_stops_its_transcription(engine, speech):
    async with Recorder(engine, MANUAL) as rec:
        item = await _commit(rec, np.tile(speech, 4))
        await rec.until(lambda ev: rec.of(f"{EVENT}.delta", item))
        await rec.send({"type": "conversation.item.delete", "item_id": item})
        await _settle(engine)
    assert rec.aborted == [rec.submits[-1][0]]  # the transcription, in the engine
    deleted = _types(rec.events).index("conversation.item.deleted")  # the events the reader had read were no mark
    assert not [e for e in rec.events[deleted:] if e["type"].startswith(EVENT)]
    assert not rec.of(f"{EVENT}.completed") and not rec.of(f"{EVENT}.failed")


async def test_closing_mid_transcription_leaks_nothing_and_sends_nothing_after(engine, speech):
    """A long turn's transcription is running when the session closes: the engine frees its slot, and no
    transcription event follows the close."""
    async with Recorder(engine, MANUAL) as rec:
        item = await _commit(rec, np.tile(speech, 4))
        await rec.until(lambda ev: rec.of(f"{EVENT}.delta", item))
        assert engine.num_active_requests == 1
    num_events = len(rec.events)
    await _settle(engine)
    assert rec.aborted == [rec.submits[-1][0]] and rec.submits[-1][0].startswith("transcription")
    assert len(rec.events) == num_events and not rec.of(f"{EVENT}.completed")


async def _settle(engine) -> None:
    """Until the engine has no request left and every slot free (a guard against a hang, not a bound)."""
    await until(lambda: engine.num_active_requests == 0 and engine.num_free_slots() == engine.num_slots(),
                "every slot free, no request left")


async def test_a_burst_of_commits_beyond_the_queue_fails_at_once(engine):
    """Twenty short commits in a row: at most `MAX_PENDING` wait, the later ones fail at once
    (`transcription_queue_full`); every turn gets exactly one end, and those that ran complete in order."""
    tone = (0.3 * np.sin(np.arange(4800) / 5)).astype(np.float32)  # 0.2 s
    async with Recorder(engine, MANUAL) as rec:
        for _ in range(20):  # without waiting for the events in between
            await rec.speak(tone)
            await rec.send({"type": "input_audio_buffer.commit"})
        await rec.until(lambda ev: len(rec.of("input_audio_buffer.committed")) == 20)
        items = [e["item_id"] for e in rec.of("input_audio_buffer.committed")]
        await rec.until(lambda ev: all(_ended(i)(ev) for i in items))
    ends = [e for e in rec.events if e["type"] in (f"{EVENT}.completed", f"{EVENT}.failed")]
    assert sorted(e["item_id"] for e in ends) == sorted(items)
    full = [e["item_id"] for e in ends if e["type"].endswith("failed")]
    assert full and all(e["error"]["code"] == "transcription_queue_full" for e in rec.of(f"{EVENT}.failed"))
    done = [e["item_id"] for e in ends if e["type"].endswith("completed")]
    assert len(done) >= MAX_PENDING and done == [i for i in items if i not in full]  # in commit order


# ---- transcription sessions -----------------------------------------------------------------------------

PIPECAT_UPDATE = {"type": "transcription", "audio": {"input": {  # what pipecat's OpenAIRealtimeSTTService sends
    "format": {"type": "audio/pcm", "rate": 24000},
    "transcription": {"model": "gpt-realtime-whisper", "language": "en"}, "turn_detection": None}}}


def test_transcription_session_settings():
    """A realtime session becomes a transcription session (transcription on, VAD that never responds) and stays
    one; it takes only the transcription fields; its session object is of both generations, and sent back as is."""
    cfg = SessionConfig(model="tiny", voice="ethan")
    became = apply_update(cfg, {"type": "transcription"}, VOICES)
    assert became.type == "transcription" and became.transcription == TranscriptionConfig("tiny")
    assert not became.turn_detection.create_response and not became.turn_detection.interrupt_response
    pipecat = apply_update(cfg, PIPECAT_UPDATE, VOICES)
    assert pipecat.transcription == TranscriptionConfig("gpt-realtime-whisper", "en") and pipecat.turn_detection is None
    vad = apply_update(pipecat, {"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.6}}}},
                       VOICES)  # no type: the session's
    assert vad.type == "transcription" and vad.turn_detection.threshold == 0.6
    assert not vad.turn_detection.create_response and not vad.turn_detection.interrupt_response
    beta = apply_update(cfg, {"type": "transcription", "input_audio_format": "g711_ulaw", "turn_detection": None,
                              "input_audio_transcription": {"model": "gpt-4o-transcribe", "prompt": "cooking"},
                              "include": [], "modalities": ["text"]}, VOICES)
    assert beta.transcription == TranscriptionConfig("gpt-4o-transcribe", None, "cooking")
    assert beta.input_format.name == "g711_ulaw" and beta.turn_detection is None
    kind, ga_obj = session_event(vad, "s", False, "updated")
    assert kind == "session.updated" and ga_obj["type"] == "transcription"
    assert ga_obj["object"] == "realtime.transcription_session" and set(ga_obj["audio"]) == {"input"}
    assert ga_obj["audio"]["input"]["turn_detection"] == {"type": "server_vad", "threshold": 0.6,
                                                          "prefix_padding_ms": 300, "silence_duration_ms": 500,
                                                          "idle_timeout_ms": None}
    kind, beta_obj = session_event(beta, "s", True, "created")
    assert kind == "transcription_session.created" and beta_obj["input_audio_format"] == "g711_ulaw"
    assert beta_obj["input_audio_transcription"] == {"model": "gpt-4o-transcribe", "language": None,
                                                     "prompt": "cooking"}
    assert session_event(cfg, "s", True, "created")[0] == "session.created"  # a realtime session's, unchanged
    assert apply_update(vad, ga_obj, VOICES) == vad and apply_update(beta, beta_obj, VOICES) == beta  # sent back
    for bad, param, code in [
            ({"type": "realtime"}, "session.type", "invalid_value"),  # it stays a transcription session
            ({"type": "translation"}, "session.type", "invalid_value"),
            ({"instructions": "x"}, "session.instructions", "unknown_parameter"),
            ({"voice": "ethan"}, "session.voice", "unknown_parameter"),
            ({"audio": {"output": {"voice": "ethan"}}}, "session.audio.output", "unknown_parameter"),
            ({"include": ["item.input_audio_transcription.logprobs"]}, "session.include", "unsupported_parameter"),
            ({"turn_detection": {"type": "server_vad", "create_response": True}},
             "session.turn_detection.create_response", "unsupported_parameter"),
            ({"audio": {"input": {"turn_detection": {"interrupt_response": True}}}},
             "session.audio.input.turn_detection.interrupt_response", "unsupported_parameter"),
            ({"audio": {"input": {"transcription": {"model": "whisper-2"}}}},
             "session.audio.input.transcription.model", "invalid_value")]:
        with pytest.raises(ProtocolError) as err:
            apply_update(pipecat, bad, VOICES)
        assert (err.value.param, err.value.code) == (param, code), bad
    assert apply_update(cfg, {"type": "realtime", "instructions": "x"}, VOICES).type == "realtime"


async def test_a_transcription_session_transcribes_each_turn_and_never_responds(engine, speech):
    """GA: a server-VAD turn gives speech_started, speech_stopped, committed, the user item, then the
    transcription's deltas and `.completed` with usage; no response starts, and `response.create` is refused
    in OpenAI's error shape. The only engine request is the transcription."""
    update = {**PIPECAT_UPDATE, "audio": {"input": {**PIPECAT_UPDATE["audio"]["input"],
                                                    "turn_detection": {"type": "server_vad"}}}}
    async with Recorder(engine, update) as rec:
        await rec.speak(speech)
        item = (await _wait(rec, "input_audio_buffer.committed"))["item_id"]
        await rec.until(_ended(item))
        await rec.send({"type": "response.create", "event_id": "evt_1"})
        await rec.until(lambda ev: "error" in _types(ev))
    kinds = [k for k in _types(rec.events) if not k.endswith(".delta")]
    assert kinds == ["session.created", "session.updated", "input_audio_buffer.speech_started",
                     "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
                     "conversation.item.done", f"{EVENT}.completed", "error"]
    assert rec.of("session.updated")[0]["session"]["type"] == "transcription"
    assert rec.of("input_audio_buffer.speech_started")[0]["item_id"] == item
    assert rec.of("conversation.item.added")[0]["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    deltas, (done,) = rec.of(f"{EVENT}.delta", item), rec.of(f"{EVENT}.completed", item)
    assert deltas and "".join(d["delta"] for d in deltas) == done["transcript"]
    assert done["usage"]["type"] == "tokens" and done["usage"]["output_tokens"] >= len(deltas)
    assert rec.of("error")[0]["error"] == {
        "type": "invalid_request_error", "code": "unsupported_event", "param": "type", "event_id": "evt_1",
        "message": "a transcription session generates no responses: it transcribes the input audio"}
    assert [s[0].split("_")[0] for s in rec.submits] == ["transcription"] and engine.num_active_requests == 0


async def test_beta_transcription_session_update(engine, speech):
    """Beta: a session opened for transcription (`?intent=transcription`) says `transcription_session.created`;
    `transcription_session.update` is answered by `transcription_session.updated`; a manual commit gives the
    beta item event and the transcription's."""
    start = as_transcription(initial_config(engine.info(), "tiny", ""), "gpt-4o-transcribe")
    async with Recorder(engine, None, beta=True, config=start) as rec:
        await rec.send({"type": "transcription_session.update", "session": {
            "input_audio_transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"},
            "turn_detection": None, "input_audio_noise_reduction": None}})
        await rec.until(lambda ev: "transcription_session.updated" in _types(ev))
        item = await _commit(rec, speech)
        await rec.until(_ended(item))
        await rec.send({"type": "transcription_session.update", "session": {"instructions": "x"}})
        await rec.until(lambda ev: "error" in _types(ev))
    kinds = [k for k in _types(rec.events) if not k.endswith(".delta")]
    assert kinds == ["transcription_session.created", "transcription_session.updated", "input_audio_buffer.committed",
                     "conversation.item.created", f"{EVENT}.completed", "error"]
    created, updated = rec.of("transcription_session.created")[0], rec.of("transcription_session.updated")[0]
    assert created["session"]["input_audio_transcription"]["model"] == "gpt-4o-transcribe"
    assert created["session"]["turn_detection"] == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                                    "silence_duration_ms": 500, "idle_timeout_ms": None}
    assert updated["session"]["input_audio_transcription"] == {"model": "gpt-4o-mini-transcribe", "language": "en",
                                                              "prompt": None}
    assert updated["session"]["turn_detection"] is None and rec.of(f"{EVENT}.completed", item)[0]["transcript"]
    assert rec.of("error")[0]["error"]["param"] == "session.instructions"
