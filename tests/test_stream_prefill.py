"""Streaming the user's audio into the Thinker while they speak (`omnirt/pipeline/models/qwen3_omni/audio_windows.py`):
a prompt's audio is keyed per encoder window, a `prefill_only` request prefills the settled windows of the audio heard
so far, and the turn's real request reuses that prefix and answers exactly as a whole prefill does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from omnirt.loadtest.gpu import hf_parity
from omnirt.pipeline.api import Finished, OmniRequest, RequestError, TextDelta, collect_reply
from omnirt.pipeline.models.qwen3_omni.encoders import encode_audio
from tests.test_parity import started_engine

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


def test_a_settled_windows_encoder_rows_are_the_whole_utterances(engines):
    models = engines[0].models
    audio = speech_like(19.0)
    full, part = models.encoder.encode(turn(audio)), models.encoder.encode_settled(turn(audio[:int(17.3 * RATE)]))
    with torch.inference_mode():
        whole, heard = (encode_audio(models.hf.thinker, torch.device("cpu"), [p], [0])[0] for p in (full, part))
    assert heard.shape[0] == 208 and whole.shape[0] == full.num_audio_tokens
    torch.testing.assert_close(heard, whole[:208], rtol=1e-5, atol=1e-5)


# ---- the engine: a two-part prefill answers as a whole one ---------------------------------------------------


async def _greedy(engine, rid: str, messages: list[dict]):
    req = OmniRequest(rid, messages, thinker_sampling={"temperature": 0.0, "max_tokens": 8})
    reply = await collect_reply(await engine.submit(req))
    return reply, engine.tap.reply(rid, reply.token_ids, []).thinker


async def _prefill(engine, rid: str, messages: list[dict]) -> Finished:
    events = [ev async for ev in await engine.submit(OmniRequest(rid, messages, prefill_only=True))]
    assert not any(isinstance(ev, TextDelta) for ev in events) and isinstance(events[-1], Finished)
    return events[-1]


@pytest.mark.parametrize("loud_last_s", [0.0, 1.0])
async def test_a_speculative_prefix_is_reused_and_the_answer_is_a_whole_prefills(engines, loud_last_s):
    on, off = engines
    audio = speech_like(19.0, loud_last_s, seed=int(loud_last_s))
    tag = f"two-part-{loud_last_s}"
    spec = await _prefill(on, f"{tag}-spec", turn(audio[:int(17.3 * RATE)]))
    full = on.models.encoder.encode(turn(audio))
    start = full.audio_spans[0][0]
    assert spec.usage.prompt_tokens == start + 208 and spec.usage.completion_tokens == 0
    (reused, reused_logits), (whole, whole_logits) = (await _greedy(on, f"{tag}-on", turn(audio)),
                                                      await _greedy(off, f"{tag}-off", turn(audio)))
    assert reused.token_ids == whole.token_ids and len(reused_logits) == len(whole_logits) > 0
    for a, b in zip(reused_logits, whole_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    cached = reused.finished.usage.cached_tokens
    if loud_last_s:  # the clamp moved: only the text before the audio matched (the system turn's slot)
        assert cached <= start, cached
    else:
        assert cached == start + 208, cached
    assert whole.finished.usage.cached_tokens == 0


async def test_a_prefill_only_request_with_nothing_settled_is_refused(engines):
    with pytest.raises(RequestError, match="nothing to prefill"):
        await engines[0].submit(OmniRequest("too-early", turn(speech_like(3.0)), prefill_only=True))
