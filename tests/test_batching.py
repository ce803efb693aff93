"""Continuous batching: N concurrent requests give exactly what the same requests give one at a time."""

from __future__ import annotations

import asyncio
import contextlib

from omnirt.pipeline.api import AudioChunk, OmniRequest, collect_reply
from tests.conftest import until


async def run(engine, rid: str, text: str, audio: bool):
    req = OmniRequest(rid, [{"role": "user", "content": text}], ("text", "audio") if audio else ("text",),
                      thinker_sampling={"max_tokens": 10 + len(text) % 7},
                      talker_sampling={"max_tokens": 20 + len(text) % 11})
    reply = await collect_reply(await engine.submit(req))
    return reply.text, reply.pcm16, reply.finished.finish_reason


PROMPTS = [("Tell me a story about a dragon.", True), ("What is the weather?", False),
           ("Hello there, how are you?", True), ("Numbers 1 2 3 4 5", True), ("Quick brown fox", False),
           ("A brave knight and a castle", True)]


async def test_concurrent_equals_sequential(engine):
    sequential = [await run(engine, f"seq-{i}", t, a) for i, (t, a) in enumerate(PROMPTS)]
    concurrent = await asyncio.gather(*(run(engine, f"con-{i}", t, a) for i, (t, a) in enumerate(PROMPTS)))
    for (text_s, pcm_s, fin_s), (text_c, pcm_c, fin_c), (_, audio) in zip(sequential, concurrent, PROMPTS):
        assert text_s == text_c and fin_s == fin_c
        assert len(pcm_c) == len(pcm_s) and (len(pcm_s) > 0) == audio
        diff = max((abs(a - b) for a, b in zip(memoryview(pcm_s).cast("h"), memoryview(pcm_c).cast("h"))),
                   default=0)
        assert diff <= 2  # int16 steps: batched float math may differ in the last bits
    assert engine.num_free_slots() == engine.num_slots()


async def test_text_only_never_touches_speech_stages(engine):
    before = engine.stage("talker").counters.num_steps, engine.stage("code2wav").counters.num_steps
    text, pcm, reason = await run(engine, "text-only", "Just text please", audio=False)
    assert text and pcm == b"" and reason in ("stop", "length")
    assert (engine.stage("talker").counters.num_steps, engine.stage("code2wav").counters.num_steps) == before


async def test_abort_frees_every_stage(engine):
    req = OmniRequest("abort-me", [{"role": "user", "content": "Talk for a long time"}], ("text", "audio"),
                      thinker_sampling={"max_tokens": 60}, talker_sampling={"max_tokens": 400, "min_tokens": 400})
    events = await engine.submit(req)
    async for ev in events:
        if isinstance(ev, AudioChunk):
            break
    await events.aclose()  # the consumer went away: the engine aborts in all stages
    await until(lambda: engine.num_free_slots() == engine.num_slots() and engine.num_active_requests == 0,
                "every slot free, no request left")
    assert all(not s.requests for s in engine.stages)


async def test_one_token_reply_has_no_speech_and_frees_slots(engine):
    """The reference cannot speak a one-token reply (its prefix needs the first text token after the
    assistant tag); the engine ends the speech stages cleanly instead."""
    req = OmniRequest("one-token", [{"role": "user", "content": "Hi"}], ("text", "audio"),
                      thinker_sampling={"max_tokens": 1})
    reply = await collect_reply(await engine.submit(req))
    assert reply.finished.finish_reason == "length" and reply.pcm16 == b""
    await until(lambda: engine.num_free_slots() == engine.num_slots(), "every slot free")
    assert not any(s.requests for s in engine.stages)


def test_audio_of_requests_that_prefill_together_is_encoded_in_one_batch(engine):
    """The Thinker stage encodes the audio of every request in a prefill step in one encoder call; each
    request gets the rows it gets alone (different lengths, a text-only request among them)."""
    import numpy as np
    import torch

    from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerInput
    from omnirt.pipeline.stage.request import StageRequest

    models, rng = engine.models, np.random.default_rng(1)
    msgs = [[{"role": "user", "content": [{"type": "audio", "audio": rng.standard_normal(n).astype(np.float32) * 0.1},
                                          {"type": "text", "text": "What?"}]}] if n else
            [{"role": "user", "content": "Only text."}] for n in (16000, 0, 9000, 24000)]
    prompts = [models.encoder.encode(m) for m in msgs]
    thinker, calls = models.thinker, []
    with _spied_audio_encoder(calls):
        alone = [StageRequest(f"a{i}", None, ThinkerInput(p, False)) for i, p in enumerate(prompts)]
        for r in alone:
            thinker.prepare([r])
        together = [StageRequest(f"t{i}", None, ThinkerInput(p, False)) for i, p in enumerate(prompts)]
        calls.clear()
        thinker.prepare(together)
    assert [len(c) for c in calls] == [3]  # one encoder call for the three audios
    for a, t in zip(alone, together):
        assert torch.allclose(a.state.embeds, t.state.embeds, atol=1e-5)
        assert torch.equal(a.state.position_ids, t.state.position_ids)


async def test_step_log_has_a_line_per_step_of_every_stage(tiny_config, tmp_path):
    """`--step-log`: each stage appends one whole line per step (time, stage, kind, requests, tokens, ms); the
    lines add up to the steps the stage counted, a decode step carries a token per request."""
    import dataclasses

    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    path = tmp_path / "steps.log"
    cfg = dataclasses.replace(tiny_config, step_log=str(path))
    eng = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    eng.start()
    try:
        await asyncio.gather(*(run(eng, f"log-{i}", t, a) for i, (t, a) in enumerate(PROMPTS[:3])))
    finally:
        eng.stop()  # a step is counted and logged once its results are routed: read them once the threads stop
    counted = {s.name: sum(s.counters.batch_size_counts) for s in eng.stages}
    lines = [line.split() for line in path.read_text().splitlines()]
    assert lines and all(len(f) == 6 and f[2] in ("prefill", "decode") for f in lines), lines[:3]
    assert {name: sum(f[1] == name for f in lines) for name in counted} == counted
    thinker = [f for f in lines if f[1] == "thinker"]
    assert {f[2] for f in thinker} == {"prefill", "decode"}
    assert all(int(f[4]) == int(f[3]) for f in thinker if f[2] == "decode")  # a token per request
    assert sum(int(f[4]) for f in thinker if f[2] == "prefill") == eng.stages[0].scheduler.num_prefill_tokens


def test_encoders_warm_up_once_each_on_a_dummy_prompt(engine):
    """Start-up on a device runs the audio and vision encoders once (their first call there sets up what later
    calls reuse): one second of audio, one image, nothing written to any stage's slots."""
    model, audio_frames, images = engine.models.thinker.thinker.model, [], []
    encode_images = model.get_image_features
    model.get_image_features = lambda *a, **kw: images.append(tuple(a[0].shape)) or encode_images(*a, **kw)
    free = engine.num_free_slots()
    try:
        with _spied_audio_encoder(audio_frames):
            engine.models.warm_encoders()
    finally:
        del model.get_image_features
    rate, hop = engine.models.input_sample_rate, engine.models.encoder.features.hop_length
    assert audio_frames == [[rate // hop]] and len(images) == 1, (audio_frames, images)
    assert engine.num_free_slots() == free


def test_audio_rows_equal_transformers_encoder_with_no_device_reads(engine):
    """On the CPU `audio_tower_rows` gives the rows transformers' `get_audio_features` gives (bit for bit: audios of
    one and two attention windows, chunks cut short, a batch of four), and works out every length on the host: on the
    meta device, where reading a tensor back fails, it runs, and transformers' own call does not."""
    import copy

    import numpy as np
    import pytest
    import torch

    from omnirt.pipeline.models.qwen3_omni.encoders import audio_tower_rows

    models, rng = engine.models, np.random.default_rng(3)
    audios = [rng.standard_normal(int(s * 16000)).astype(np.float32) * 0.1 for s in (9.5, 1.0, 0.33, 2.57)]
    prompt = models.encoder.encode([{"role": "user", "content": [{"type": "audio", "audio": a} for a in audios]}])
    model = models.thinker.thinker.model
    features, mask = prompt.input_features, prompt.feature_mask
    with torch.inference_mode():
        ours = audio_tower_rows(model.audio_tower, features, mask, torch.device("cpu"), features.dtype)
        theirs = model.get_audio_features(features, mask, return_dict=True).last_hidden_state
        assert ours.shape == theirs.shape == (prompt.num_audio_tokens, ours.shape[-1])
        assert torch.equal(ours, theirs)
        meta = copy.deepcopy(model).to("meta")
        assert audio_tower_rows(meta.audio_tower, features, mask, torch.device("meta"), features.dtype).shape \
            == ours.shape
        with pytest.raises((NotImplementedError, RuntimeError)):
            meta.get_audio_features(features.to("meta"), mask.to("meta"), return_dict=True)


def test_audio_windows_attend_in_one_call_a_layer(engine, monkeypatch):
    """With `one_call` (the default off the CPU for more than one window) each encoder layer attends over every
    window of every audio in one SDPA call, where transformers makes one a window, and the rows equal transformers'
    (fp32, to 1e-5 of the largest: the padded batch sums in another order, so not bit for bit); with the padding
    left unmasked they would not."""
    import dataclasses

    import numpy as np
    import torch

    from omnirt.pipeline.models.qwen3_omni import encoders

    models, rng = engine.models, np.random.default_rng(5)
    audios = [rng.standard_normal(int(s * 16000)).astype(np.float32) * 0.1 for s in (9.5, 1.0, 0.33, 2.57)]
    prompt = models.encoder.encode([{"role": "user", "content": [{"type": "audio", "audio": a} for a in audios]}])
    model, calls = models.thinker.thinker.model, []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or sdpa(q, *a, **kw))
    args = (model.audio_tower, prompt.input_features, prompt.feature_mask, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        theirs = encoders.audio_tower_rows(*args)
        per_window, calls[:] = list(calls), []
        ours = encoders.audio_tower_rows(*args, one_call=True)
        one_call, calls[:] = list(calls), []
        of = encoders.AudioWindows.of
        monkeypatch.setattr(encoders.AudioWindows, "of", lambda *a: dataclasses.replace(
            w := of(*a), keep=torch.ones_like(w.keep)))
        unmasked = encoders.audio_tower_rows(*args, one_call=True)
    layers, windows = len(model.audio_tower.layers), 5  # 9.5 s: two 8 s windows; the other three one each
    assert len(per_window) == layers * windows and one_call == [windows] * layers, (per_window, one_call)
    assert model.audio_tower.config._attn_implementation not in (None, encoders.AudioWindows.NAME)  # put back
    error, leak = ((rows - theirs).abs().max() / theirs.abs().max() for rows in (ours, unmasked))
    assert error < 1e-5 < 1e-3 < leak, (error, leak)


def test_one_call_is_the_default_only_for_several_windows_off_the_cpu():
    """A single window gains nothing from the padded batch (slower on an H100), and the CPU keeps transformers' path."""
    import torch

    from omnirt.pipeline.models.qwen3_omni.encoders import attends_in_one_call

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [attends_in_one_call(cuda, n) for n in (1, 2, 7)] == [False, True, True]
    assert not attends_in_one_call(cpu, 7)


@contextlib.contextmanager
def _spied_audio_encoder(calls: list):
    """While inside, each call of the audio encoder appends the mel frames of each audio it is given."""
    from omnirt.pipeline.models.qwen3_omni import encoders

    original = encoders.audio_tower_rows

    def spy(tower, features, mask, *args):
        calls.append([int(n) for n in mask.sum(-1)])
        return original(tower, features, mask, *args)

    encoders.audio_tower_rows = spy
    try:
        yield
    finally:
        encoders.audio_tower_rows = original
