"""Correctness of the engine = parity with transformers' own generate() on the same tiny weights."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from pipeline.api import OmniRequest, collect_reply

THINKER_TOKENS, TALKER_TOKENS = 12, 40


def _audio_1s() -> np.ndarray:
    t = np.arange(16000) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t) * np.exp(-t)).astype(np.float32)


PROMPTS = {
    "text": [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "Hello, how are you today?"}],
    "audio": [{"role": "user", "content": [{"type": "audio", "audio": _audio_1s()},
                                           {"type": "text", "text": "What is in this audio clip?"}]}],
}


def reference_generate(hf, prompt):
    """transformers' generate(), capturing the codec codes it hands to code2wav."""
    captured = {}
    original = hf.code2wav.chunked_decode

    def capture(codes, *a, **k):
        captured["codes"] = codes.clone()
        return original(codes, *a, **k)

    hf.code2wav.chunked_decode = capture
    try:
        ids = torch.tensor([prompt.input_ids])
        kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if prompt.input_features is not None:
            kw.update(input_features=prompt.input_features, feature_attention_mask=prompt.feature_mask)
        seqs, _ = hf.generate(**kw, speaker="ethan", return_audio=True, thinker_max_new_tokens=THINKER_TOKENS,
                              thinker_do_sample=False, thinker_eos_token_id=hf.config.im_end_token_id,
                              talker_max_new_tokens=TALKER_TOKENS, talker_do_sample=False,
                              talker_repetition_penalty=1.05)
    finally:
        hf.code2wav.chunked_decode = original
    return seqs[0, len(prompt.input_ids):].tolist(), captured["codes"][0].T.tolist()


async def engine_generate(engine, rid, messages, **request):
    """Run one request (`request`: more OmniRequest fields); returns (token ids, codec frames fed to the
    vocoder, streamed PCM as float, Finished)."""
    frames, original = [], engine.models.code2wav.decode

    def capture(windows):
        for w in windows:
            if w.codes and getattr(w, "_rid", rid) == rid:
                frames.extend(w.codes[w.num_context:])
        return original(windows)

    engine.models.code2wav.decode = capture
    try:
        req = OmniRequest(rid, messages, ("text", "audio"), voice="ethan",
                          thinker_sampling={"temperature": 0.0, "max_tokens": THINKER_TOKENS},
                          talker_sampling={"temperature": 0.0, "max_tokens": TALKER_TOKENS,
                                           "repetition_penalty": 1.05}, **request)
        reply = await collect_reply(await engine.submit(req))
    finally:
        engine.models.code2wav.decode = original
    pcm = np.frombuffer(reply.pcm16, "<i2").astype(np.float32) / 32768.0
    return reply.token_ids, frames, pcm, reply.finished


@contextlib.contextmanager
def started_engine(cfg):
    """An in-process engine over `cfg` on the CPU (for a variant of the tiny profile), stopped on exit."""
    from pipeline.engine import OmniEngine
    from pipeline.models import load_models
    from pipeline.platform import get_platform

    eng = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


async def assert_greedy_parity(engine, reference_model, rid: str, kind: str) -> None:
    """The engine's greedy text tokens and all 16 codebooks of every codec frame equal generate()'s."""
    models = engine.models
    ref_tokens, ref_frames = reference_generate(reference_model, models.encoder.encode(PROMPTS[kind]))
    tokens, frames, _, _ = await engine_generate(engine, rid, PROMPTS[kind])
    assert tokens == [t for t in ref_tokens if t not in models.thinker.eos_ids]
    assert frames == ref_frames and len(frames) > 8


@pytest.mark.parametrize("kind", ["text", "audio"])
async def test_engine_matches_transformers_generate(engine, reference_model, kind):
    prompt = engine.models.encoder.encode(PROMPTS[kind])
    ref_tokens, ref_frames = reference_generate(reference_model, prompt)
    tokens, frames, pcm, fin = await engine_generate(engine, f"parity-{kind}", PROMPTS[kind])

    eos = engine.models.thinker.eos_ids
    assert tokens == [t for t in ref_tokens if t not in eos]  # text deltas carry every non-EOS token
    assert fin.usage.completion_tokens == len(ref_tokens)
    assert len(frames) == len(ref_frames) > 8
    assert frames == ref_frames  # all 16 codebooks, every frame

    # streamed, chunked audio == one-shot decode of the same codes, sample for sample
    full = engine.models.code2wav.decode_full(frames)
    assert len(pcm) == len(full) == len(frames) * 1920 - engine.models.code2wav.tail
    assert np.abs(pcm - full).max() < 1e-4
    assert np.abs(full).max() > 0.05  # audible range, not ~1e-6


def test_streaming_chunks_join_without_gap(engine):
    """Any chunking of any code sequence reproduces the one-shot decode: no missing or repeated samples."""
    from pipeline.connector import CodecStream

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 64, size=(61, 16)).tolist()
    full = engine.models.code2wav.decode_full(frames)
    for initial, chunk, ctx in [(4, 12, 72), (2, 5, 100), (1, 25, 25), (3, 7, 1)]:
        stream = CodecStream(initial, chunk, ctx, frames=list(frames), input_done=True)
        pieces = []
        while not stream.is_drained():
            window, n = stream.next_window()
            pieces.append(engine.models.code2wav.decode([window])[0])
            stream.advance(n)
        out = np.concatenate(pieces)
        assert len(out) == len(full), (initial, chunk, ctx)
        tol = 1e-4 if ctx >= 72 else 0.05  # context shorter than the attention window only approximates it
        assert np.abs(out - full).max() < tol, (initial, chunk, ctx)
