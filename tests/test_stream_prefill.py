"""Streaming the user's audio into the Thinker while they speak (`omnirt/pipeline/models/qwen3_omni/audio_windows.py`):
a prompt's audio is keyed per encoder window, a `prefill_only` request prefills the settled windows of the audio heard
so far, and the turn's real request reuses that prefix and answers exactly as a whole prefill does."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from omnirt.loadtest.gpu import hf_parity
from omnirt.pipeline.api import Finished, OmniRequest, RequestError, TextDelta, Usage, collect_reply
from omnirt.pipeline.models.qwen3_omni.encoders import AudioStart, encode_audio
from tests.conftest import until
from tests.realtime_helpers import collected_session
from tests.test_parity import engine_generate, started_engine

RATE = 16000


def speech_like(seconds: float, loud_last_s: float = 0.0, seed: int = 0) -> np.ndarray:
    """A voiced sound whose loudest part is its first second (so a heard part holds the utterance's maximum),
    but for a last `loud_last_s` seconds 3x louder."""
    t = np.arange(int(RATE * seconds)) / RATE
    rng = np.random.default_rng(seed)
    envelope = np.where(t < 1.0, 0.5, 0.3) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))
    envelope[t >= seconds - loud_last_s] *= 3
    wave = sum(np.sin(2 * np.pi * f * t + p) / k for k, (f, p) in enumerate(zip((180, 360, 720), (0, 1, 2)), 1))
    return (envelope * wave / 2 + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def turn(audio: np.ndarray) -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "audio", "audio": audio}]}]


def _with(cfg, reuse: bool):
    stages = [dataclasses.replace(s, prefix_caching=reuse) for s in cfg.stages]
    return dataclasses.replace(cfg, stages=tuple(stages))


@pytest.fixture(scope="module")
def engines(tiny_config):
    """(reuse on, reuse off), each with a tap of its Thinker's logits."""
    with started_engine(_with(tiny_config, True)) as on, started_engine(_with(tiny_config, False)) as off:
        on.tap, off.tap = hf_parity.Tap(on), hf_parity.Tap(off)
        yield on, off


# ---- keys, features and encoder rows per window ------------------------------------------------------------


def test_a_heard_part_settles_whole_windows_and_its_key_is_the_whole_utterances(engines):
    encoder = engines[0].models.encoder
    w = encoder.windows
    assert (w.window_samples, w.lookahead_samples) == (128000, 40)  # 8 s windows; an STFT frame reads 40 samples on
    audio = speech_like(19.0)
    full = encoder.encode(turn(audio))
    start = full.audio_spans[0][0]
    for heard, windows in ((2 * w.window_samples + w.lookahead_samples - 1, 1), (2 * w.window_samples + 40, 2),
                           (int(18.5 * RATE), 2)):
        assert w.num_settled(heard) == windows
        part = encoder.encode_settled(turn(audio[:heard]))
        assert len(part.input_ids) == start + 104 * windows and part.audio_spans[-1] == (start, start + 104 * windows)
        assert part.cache_key == full.cache_key[:len(part.cache_key)]  # its every position matches the whole one
        assert part.input_ids == full.input_ids[:len(part.input_ids)]
    assert encoder.encode_settled(turn(audio[:w.window_samples + 39])) is None
    key = np.frombuffer(full.cache_key, np.int64)[start:full.audio_spans[0][1]]
    assert len(set(key[:104])) == len(set(key[104:208])) == 1 and key[0] != key[104]  # one digest per window


def test_a_louder_later_part_moves_the_clamp_so_the_earlier_windows_no_longer_match(engines):
    """Whisper's features are clamped at the clip's maximum - 8 (then / 4): the louder end raises the floor,
    and the first window's values move by at most the rise of the maximum. Its digest then differs: no reuse."""
    encoder = engines[0].models.encoder
    audio = speech_like(19.0, loud_last_s=1.0)
    heard = audio[:int(17 * RATE)]
    full, part = encoder.encode(turn(audio)), encoder.encode_settled(turn(heard))
    frames = 2 * encoder.windows.n_window_infer
    a, b = full.input_features[0, :, :frames], part.input_features[0, :, :frames]
    rise = float(full.input_features[0].max() - part.input_features[0, :, :int(part.feature_mask[0].sum())].max())
    diff = float((a - b).abs().max())
    assert 0.1 < rise and 0 < diff <= rise + 1e-6, (diff, rise)
    start = full.audio_spans[0][0]
    assert part.cache_key[:8 * start] == full.cache_key[:8 * start]
    assert part.cache_key[8 * start:8 * (start + 1)] != full.cache_key[8 * start:8 * (start + 1)]


def test_each_windows_encoder_rows_are_the_whole_utterances(engines):
    """The settled windows encoded alone, and the rest encoded from a window boundary on (what a request that starts
    from a speculative prefix encodes), give the whole utterance's rows."""
    models = engines[0].models
    audio = speech_like(19.0)
    full, part = models.encoder.encode(turn(audio)), models.encoder.encode_settled(turn(audio[:int(17.3 * RATE)]))
    rest = AudioStart.after(full, full.audio_spans[0][0] + 208 + 5, 800, 104)  # 5 positions into the third window
    assert rest == AudioStart(0, 1600, 208)

    def rows(prompt, start):
        with torch.inference_mode():
            return encode_audio(models.hf.thinker, torch.device("cpu"), [prompt], [start])[0]

    whole, heard, after = rows(full, AudioStart()), rows(part, AudioStart()), rows(full, rest)
    assert heard.shape[0] == 208 and whole.shape[0] == full.num_audio_tokens == 208 + after.shape[0]
    torch.testing.assert_close(heard, whole[:208], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, whole[208:], rtol=1e-5, atol=1e-5)


# ---- the engine: a two-part prefill answers as a whole one ---------------------------------------------------


async def _greedy(engine, rid: str, messages: list[dict]):
    req = OmniRequest(rid, messages, thinker_sampling={"temperature": 0.0, "max_tokens": 8})
    reply = await collect_reply(await engine.submit(req))
    return reply, engine.tap.reply(rid, reply.token_ids, []).thinker


async def _prefill(engine, rid: str, messages: list[dict]) -> Finished:
    events = [ev async for ev in await engine.submit(OmniRequest(rid, messages, prefill_only=True))]
    assert not any(isinstance(ev, TextDelta) for ev in events) and isinstance(events[-1], Finished)
    return events[-1]


@contextlib.contextmanager
def _encoded_frames(engine):
    """The mel frames of each audio the engine's audio encoder is given, while inside."""
    from omnirt.pipeline.models.qwen3_omni import encoders

    seen, original, mine = [], encoders.audio_tower_rows, engine.models.hf.thinker.model.audio_tower

    def spy(tower, features, mask, *args):
        if tower is mine:
            seen.extend(int(n) for n in mask.sum(-1))
        return original(tower, features, mask, *args)

    encoders.audio_tower_rows = spy
    try:
        yield seen
    finally:
        encoders.audio_tower_rows = original


@pytest.mark.parametrize("loud_last_s", [0.0, 1.0])
async def test_a_speculative_prefix_is_reused_and_the_answer_is_a_whole_prefills(engines, loud_last_s):
    on, off = engines
    audio = speech_like(19.0, loud_last_s, seed=int(loud_last_s))
    tag = f"two-part-{loud_last_s}"
    spec = await _prefill(on, f"{tag}-spec", turn(audio[:int(17.3 * RATE)]))
    full = on.models.encoder.encode(turn(audio))
    start = full.audio_spans[0][0]
    assert spec.usage.prompt_tokens == start + 208 and spec.usage.completion_tokens == 0
    with _encoded_frames(on) as frames:
        reused, reused_logits = await _greedy(on, f"{tag}-on", turn(audio))
    whole, whole_logits = await _greedy(off, f"{tag}-off", turn(audio))
    assert frames == [300 if not loud_last_s else 1900]  # the audio encoder ran on what the prefix does not hold
    assert reused.token_ids == whole.token_ids and len(reused_logits) == len(whole_logits) > 0
    for a, b in zip(reused_logits, whole_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    cached = reused.finished.usage.cached_tokens
    if loud_last_s:  # the clamp moved: only the text before the audio matched (the system turn's slot)
        assert cached <= start, cached
    else:
        assert cached == start + 208, cached
    assert whole.finished.usage.cached_tokens == 0


async def test_a_spoken_reply_from_a_speculative_prefix_is_a_whole_prefills(engines):
    """The Talker's prompt rows come from the slot the speculative prefill left (embeddings and the tapped layer):
    every codebook of every frame and the PCM equal a whole prefill's."""
    on, off = engines
    audio = speech_like(18.0, seed=5)
    spec = await _prefill(on, "spoken-spec", turn(audio[:int(17.2 * RATE)]))
    reused, whole = (await engine_generate(on, "spoken-on", turn(audio)),
                     await engine_generate(off, "spoken-off", turn(audio)))
    assert reused.finished.usage.cached_tokens == spec.usage.prompt_tokens > 208
    assert reused.tokens == whole.tokens and reused.frames == whole.frames and len(whole.frames) > 8
    assert np.array_equal(reused.pcm, whole.pcm)


async def test_a_prefill_only_request_with_nothing_settled_is_refused(engines):
    with pytest.raises(RequestError, match="nothing to prefill"):
        await engines[0].submit(OmniRequest("too-early", turn(speech_like(3.0)), prefill_only=True))


# ---- the Realtime session: speculative prefills while the user speaks ------------------------------------------

LONG_TURN = ("Hello there. Could you please tell me a short story about a friendly dragon? It should live in a "
             "castle by the sea, and it should like to bake bread for the people of the village every single morning, "
             "even when it rains. Then tell me what the dragon did on its birthday, and who came to visit it that day. "
             "Please keep it short and happy.")


@pytest.fixture(scope="module")
def long_turn(tmp_path_factory) -> np.ndarray:
    """An espeak-ng turn of about 18 s (two settled 8 s windows) at 24 kHz, its first 2 s of speech louder, so that
    the heard part holds the utterance's loudest frame (the case where reuse is possible; the other one is above)."""
    from tests.realtime_helpers import LEAD_S, espeak_utterance

    samples, seconds = espeak_utterance(tmp_path_factory.mktemp("long"), LONG_TURN)
    assert seconds > 17.0, seconds
    lead = int(LEAD_S * 24000)
    samples[lead:lead + 48000] *= 1.6
    return np.clip(samples, -1, 1)


async def _session(engine, prefill_while_speaking: bool = True, modalities: tuple[str, ...] = ("text",)):
    """A Realtime session with server VAD (1.2 s of silence ends a turn), replies of 4 tokens; its events and
    reader."""
    return await collected_session(engine, {
        "output_modalities": list(modalities), "max_output_tokens": 4, "prefill_while_speaking": prefill_while_speaking,
        "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1200}}}})


async def _speak(session, samples: np.ndarray, stop_after_sent: int | None = None) -> None:
    """Stream `samples` (24 kHz) in 100 ms chunks; after each speculative request is sent, wait for it to end (so the
    test does not race the engine); stop once `stop_after_sent` were sent."""
    spec = session.speculation
    for i in range(0, len(samples), 2400):
        sent = spec.num_sent
        await session.append_audio(samples[i:i + 2400], 24000)
        if spec.num_sent > sent:
            if stop_after_sent is not None and spec.num_sent >= stop_after_sent:
                return
            await until(lambda: not spec.is_running, "the speculative prefill's end")


async def _done(events: list[dict], start: int = 0) -> dict:
    await until(lambda: any(e["type"] == "response.done" for e in events[start:]), "response.done")
    return next(e for e in events[start:] if e["type"] == "response.done")["response"]


async def _idle(engine) -> None:
    await until(lambda: engine.num_active_requests == 0 and not engine.stage("thinker").requests, "an idle engine")
    assert engine.num_free_slots() == engine.num_slots()  # resident slots count as free


async def test_a_long_turn_is_prefilled_while_spoken_and_its_response_reuses_it(engines, long_turn):
    on, off = engines
    session, events, reader = await _session(on)
    await _speak(session, long_turn)
    response = await _done(events)
    assert session.speculation.num_sent == 2 and response["status"] in ("completed", "incomplete"), response
    audio = session.conversation.items[0].content[0].audio
    user = {"role": "user", "content": [{"type": "audio", "audio": audio}]}
    start = on.models.encoder.encode([user]).audio_spans[0][0]
    usage = response["usage"]
    assert usage["input_token_details"]["cached_tokens"] == start + 2 * 104, usage  # both settled windows
    await session.close()
    await reader
    await _idle(on)

    whole, whole_events, whole_reader = await _session(off, prefill_while_speaking=False)
    await _speak(whole, long_turn)
    whole_usage = (await _done(whole_events))["usage"]
    assert whole.speculation.num_sent == 0 and whole_usage["input_token_details"]["cached_tokens"] == 0
    assert whole_usage["input_tokens"] == usage["input_tokens"]
    await whole.close()
    await whole_reader


async def test_a_false_start_leaves_nothing_behind_and_the_next_turn_is_whole(engines, long_turn, speech):
    on, off = engines
    session, events, reader = await _session(on)
    await _speak(session, long_turn, stop_after_sent=2)
    assert session.speculation.is_running  # the second one is still running...
    await session.handle_event({"type": "input_audio_buffer.clear"})  # ...when the user's false start is thrown away
    await _idle(on)
    assert not session.conversation.items and not [e for e in events if e["type"] == "response.created"]
    await _speak(session, speech)  # the next turn: a short one, no settled window
    response = await _done(events)
    assert session.speculation.num_sent == 2 and len(session.conversation.items) == 2, response
    prompt = on.models.encoder.encode(session.conversation.history("")[:1])
    assert response["usage"]["input_tokens"] == len(prompt.input_ids), response["usage"]
    await session.close()
    await reader
    await _idle(on)


async def test_a_barge_in_turn_is_prefilled_while_spoken_and_answered_from_it(engines, long_turn):
    """The user talks over a long spoken reply: it is cancelled at speech start, the turn is prefilled while spoken
    (after the cancelled reply's text), and the next response reuses it."""
    on, _ = engines
    session, events, reader = await _session(on, modalities=("audio",))
    await session.handle_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk for a long time."}]}})
    await session.handle_event({"type": "response.create", "response": {
        "max_output_tokens": 30, "talker_sampling": {"min_tokens": 2000, "max_tokens": 2000}}})
    await until(lambda: any(e["type"] == "response.output_audio.delta" for e in events), "the reply's first audio")
    await _speak(session, long_turn)
    first = await _done(events)
    assert first["status_details"] == {"type": "cancelled", "reason": "turn_detected"}, first
    await until(lambda: sum(e["type"] == "response.created" for e in events) == 2, "the turn's response")
    created = [i for i, e in enumerate(events) if e["type"] == "response.created"]
    assert session.speculation.num_sent == 2
    second = await _done(events, created[1])
    history = session.conversation.history("")
    turn = on.models.encoder.encode(history[:history.index(next(m for m in history if m["role"] == "user"
                                                                  and m["content"][0]["type"] == "audio")) + 1])
    assert second["usage"]["input_token_details"]["cached_tokens"] == turn.audio_spans[0][0] + 2 * 104, second
    await session.close()
    await reader
    await _idle(on)


async def test_the_reference_engine_ends_a_prefill_only_request_at_once():
    """transformers' generate() keeps no KV between requests: there is nothing to prepare, and nothing runs."""
    from omnirt.pipeline.engine.reference import ReferenceEngine

    engine = ReferenceEngine(None, None)
    events = [ev async for ev in await engine.submit(OmniRequest("ref-spec", turn(speech_like(17.0)),
                                                                 prefill_only=True))]
    assert [type(ev) for ev in events] == [Finished] and events[0].usage == Usage() and not engine.num_active_requests


async def _no_events():
    async def events():
        return
        yield

    return events()


async def test_no_speculative_prefill_is_sent_while_a_reply_could_want_the_slot(engines):
    """With no free Thinker slot, or a request waiting for one, a settled window sends nothing (and the next
    window tries again)."""
    from types import SimpleNamespace

    from omnirt.app.realtime.speculation import Speculation
    from omnirt.pipeline.api import EngineStats, StageStats

    on = engines[0]
    busy = {"free_slots": 0, "waiting": 0}
    sent = []
    engine = SimpleNamespace(info=on.info, check_admission=lambda wants_audio: None, abort=lambda rid: None,
                             stats=lambda: EngineStats(stages=[StageStats("thinker", slots=2, **busy)]),
                             submit=lambda req: sent.append(req) or _no_events())
    spec = Speculation(engine, {})
    window = on.info().audio_window_samples + on.info().audio_lookahead_samples
    spec.heard(window, RATE, lambda rid: OmniRequest(rid, []))
    busy.update(free_slots=1, waiting=1)
    spec.heard(2 * window, RATE, lambda rid: OmniRequest(rid, []))
    assert not sent and spec.num_sent == 0 and spec.num_windows == 2
    busy.update(waiting=0)
    spec.heard(3 * window, RATE, lambda rid: OmniRequest(rid, []))
    assert len(sent) == spec.num_sent == 1
    await until(lambda: not spec.is_running, "the fake request's end")


async def test_a_newer_window_supersedes_the_running_speculative_prefill_and_the_turns_end_aborts_it(engines):
    from types import SimpleNamespace

    from omnirt.app.realtime.speculation import Speculation
    from omnirt.pipeline.api import EngineStats, StageStats

    on = engines[0]
    running: dict[str, asyncio.Event] = {}
    aborted: list[str] = []

    async def submit(req):
        running[req.request_id] = asyncio.Event()

        async def events():  # a prefill that ends only when aborted
            await running[req.request_id].wait()
            yield Finished(req.request_id, "abort", Usage())

        return events()

    def abort(rid):
        aborted.append(rid)
        running[rid].set()

    engine = SimpleNamespace(info=on.info, check_admission=lambda wants_audio: None, abort=abort, submit=submit,
                             stats=lambda: EngineStats(stages=[StageStats("thinker", free_slots=1, slots=2)]))
    spec = Speculation(engine, {})
    window = on.info().audio_window_samples + on.info().audio_lookahead_samples
    spec.heard(window, RATE, lambda rid: OmniRequest(rid, []))
    await asyncio.sleep(0)
    first = spec.request_id
    spec.heard(window + 1000, RATE, lambda rid: OmniRequest(rid, []))  # no new window: nothing happens
    assert spec.num_sent == 1 and not aborted
    spec.heard(2 * window, RATE, lambda rid: OmniRequest(rid, []))
    await asyncio.sleep(0)
    assert aborted == [first] and spec.num_sent == 2 and spec.is_running
    spec.end_turn()
    assert aborted == [first, spec.request_id] and spec.num_windows == 0
    await until(lambda: not spec.is_running, "the aborted prefill's end")
