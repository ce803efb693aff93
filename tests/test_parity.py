"""Correctness of the engine = parity with transformers' own generate() on the same tiny weights."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

from omnirt.pipeline.api import Finished, OmniRequest, collect_reply

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


class Reference(NamedTuple):
    tokens: list[int]  # generated text tokens, EOS included
    frames: list[list[int]]  # [frames][16]: the codec codes it hands to code2wav
    wav: np.ndarray  # float32 at 24 kHz


def reference_generate(hf, prompt, thinker_tokens: int = THINKER_TOKENS, talker_tokens: int = TALKER_TOKENS,
                       min_talker_tokens: int = 0) -> Reference:
    """transformers' generate(), greedy, capturing the codec codes it hands to code2wav."""
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
        if prompt.pixel_values is not None:
            kw.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
        if min_talker_tokens:
            kw["talker_min_new_tokens"] = min_talker_tokens
        seqs, wav = hf.generate(**kw, speaker="ethan", return_audio=True, thinker_max_new_tokens=thinker_tokens,
                                thinker_do_sample=False, thinker_eos_token_id=hf.config.im_end_token_id,
                                talker_max_new_tokens=talker_tokens, talker_do_sample=False,
                                talker_repetition_penalty=1.05)
    finally:
        hf.code2wav.chunked_decode = original
    return Reference(seqs[0, len(prompt.input_ids):].tolist(), captured["codes"][0].T.tolist(),
                     wav.reshape(-1).float().numpy())


class Window(NamedTuple):
    first: int  # the first new frame
    num_context: int  # frames of left context before it
    num_new: int


class CodecTap:
    """What the Code2Wav stage decodes, per request: every frame it was handed, and its windows. One tap at a
    time per engine (it wraps the stage's runner), shared by concurrent requests."""

    def __init__(self, engine):
        self.runner = engine.stage("code2wav").runner
        self.streams: dict[str, object] = {}
        self.windows: dict[str, list[Window]] = collections.defaultdict(list)

    def __enter__(self) -> CodecTap:
        assert "run" not in vars(self.runner), "another CodecTap is on this engine: share it"
        run = self.runner.run

        def tapped(batch):
            for r in batch.requests:
                self.streams[r.request_id] = r.state
                window, n = r.state.next_window()
                self.windows[r.request_id].append(Window(r.state.num_emitted, window.num_context, n))
            return run(batch)

        self.runner.run = tapped
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.run  # the class's own method again

    def frames(self, rid: str) -> list[list[int]]:
        stream = self.streams.get(rid)
        return list(stream.frames) if stream is not None else []


class EngineReply(NamedTuple):
    tokens: list[int]  # text tokens streamed to the client
    frames: list[list[int]]  # codec frames fed to the vocoder
    pcm: np.ndarray  # the streamed PCM as float
    finished: Finished


async def engine_generate(engine, rid, messages, thinker_tokens: int = THINKER_TOKENS,
                          talker_tokens: int = TALKER_TOKENS, min_talker_tokens: int = 0,
                          tap: CodecTap | None = None, **request) -> EngineReply:
    """Run one greedy request (`request`: more OmniRequest fields); concurrent callers share one `tap`."""
    with contextlib.nullcontext(tap) if tap is not None else CodecTap(engine) as t:
        req = OmniRequest(rid, messages, ("text", "audio"), voice="ethan",
                          thinker_sampling={"temperature": 0.0, "max_tokens": thinker_tokens},
                          talker_sampling={"temperature": 0.0, "max_tokens": talker_tokens,
                                           "min_tokens": min_talker_tokens, "repetition_penalty": 1.05}, **request)
        reply = await collect_reply(await engine.submit(req))
    pcm = np.frombuffer(reply.pcm16, "<i2").astype(np.float32) / 32768.0
    return EngineReply(reply.token_ids, t.frames(rid), pcm, reply.finished)


def as_pcm16(wav: np.ndarray) -> np.ndarray:
    """A float waveform as the engine streams it (int16 steps, as float)."""
    return (np.clip(wav, -1, 1) * 32767.0).round() / 32768.0


@contextlib.contextmanager
def started_engine(cfg):
    """An in-process engine over `cfg` on the CPU (for a variant of the tiny profile), stopped on exit."""
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    eng = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()


async def assert_greedy_parity(engine, reference_model, rid: str, kind: str) -> None:
    """The engine's greedy text tokens and all 16 codebooks of every codec frame equal generate()'s."""
    models = engine.models
    ref = reference_generate(reference_model, models.encoder.encode(PROMPTS[kind]))
    out = await engine_generate(engine, rid, PROMPTS[kind])
    assert out.tokens == [t for t in ref.tokens if t not in models.thinker.eos_ids]
    assert out.frames == ref.frames and len(out.frames) > 8


def assert_same_reply(engine, ref: Reference, out: EngineReply) -> None:
    """Text tokens, all 16 codebooks of every frame and the streamed waveform are generate()'s: the PCM to
    its int16 step, for a reply that each streamed window holds from its start (the tiny profile's 72
    frames of context; longer replies: test_vocoder_parity.py)."""
    code2wav = engine.models.code2wav
    assert out.tokens == [t for t in ref.tokens if t not in engine.models.thinker.eos_ids]
    assert len(out.frames) == len(ref.frames) > 8
    assert out.frames == ref.frames
    assert len(out.frames) <= engine.cfg.connector.codec_left_context_frames
    assert len(out.pcm) == len(ref.wav) == len(ref.frames) * code2wav.samples_per_frame - code2wav.tail
    assert np.abs(out.pcm - as_pcm16(ref.wav)).max() <= 1.5 / 32768  # a rounding step at most


@pytest.mark.parametrize("kind", ["text", "audio"])
async def test_engine_matches_transformers_generate(engine, reference_model, kind):
    ref = reference_generate(reference_model, engine.models.encoder.encode(PROMPTS[kind]))
    out = await engine_generate(engine, f"parity-{kind}", PROMPTS[kind])
    assert_same_reply(engine, ref, out)
    assert out.finished.usage.completion_tokens == len(ref.tokens)  # text deltas carry every non-EOS token
    assert np.abs(ref.wav).max() > 0.05  # audible range, not ~1e-6


def _noise(num_samples: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * 0.1).astype(np.float32)


# (messages, thinker tokens, talker tokens): prompts and replies of different lengths, text and audio. The
# third once caught the sampler dropping the repetition penalty of token 0 from a row whose history was
# shorter than another's in the batch (its frame 48, while the first request still talks).
BATCH = [
    ([{"role": "user", "content": "Hello, how are you today?"}], 24, 70),
    ([{"role": "user", "content": "Hi."}], 6, 24),
    ([{"role": "user", "content": [{"type": "audio", "audio": _noise(8000, 4)},
                                   {"type": "text", "text": "Numbers 0 1 2 3 4 5 6 7 8 9"}]}], 11, 70),
    (PROMPTS["audio"], 20, 40),
]


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def num_shared_steps(engine, before: dict[str, list[int]]) -> dict[str, int]:
    """Per stage, the steps since `before` (its batch_size_counts) that ran more than one request."""
    return {s.name: sum(s.counters.batch_size_counts[2:]) - sum(before[s.name][2:]) for s in engine.stages}


async def test_requests_batched_at_different_steps_match_their_own_generate(engine, reference_model):
    """Four requests of different prompt and reply lengths arrive at different steps (the second once the first
    decodes text, the last two together once it streams audio) and share the batches of every AR stage; each
    one's tokens, codes and waveform are those generate() gives it alone."""
    refs = [reference_generate(reference_model, engine.models.encoder.encode(m), th, tk) for m, th, tk in BATCH]
    before = {s.name: list(s.counters.batch_size_counts) for s in engine.stages}
    thinker = engine.stage("thinker")
    with CodecTap(engine) as tap:
        def start(i: int) -> asyncio.Task:
            return asyncio.create_task(engine_generate(engine, f"batch-{i}", *BATCH[i], tap=tap))

        decoded = thinker.counters.num_decode_steps
        tasks = [start(0)]
        await until(lambda: thinker.counters.num_decode_steps > decoded)
        tasks.append(start(1))
        await until(lambda: "batch-0" in tap.streams)
        tasks += [start(2), start(3)]
        outs = await asyncio.gather(*tasks)
    for ref, out in zip(refs, outs, strict=True):
        assert_same_reply(engine, ref, out)
    shared = num_shared_steps(engine, before)
    assert shared["thinker"] > 0 and shared["talker"] > 0, shared


@pytest.fixture(scope="module")
def chunked_engine(tiny_config):
    """The tiny profile with prefill chunks of at most 16 tokens and 2 slots in the Thinker and the Talker."""
    stages = [dataclasses.replace(s, max_num_batched_tokens=16, max_num_seqs=2) for s in tiny_config.stages]
    with started_engine(dataclasses.replace(tiny_config, stages=tuple(stages))) as eng:
        yield eng


LONG_PROMPT = [{"role": "system", "content": "You are a helpful voice assistant. Answer briefly and clearly."},
               {"role": "user", "content": "Tell me a long story about a dragon, a castle and a brave knight. "
                                           "The quick brown fox jumps over the lazy dog near the river bank."}]


async def test_prompts_longer_than_the_token_budget_prefill_in_chunks_as_generate(chunked_engine, reference_model):
    """Prompts of several 16-token prefill chunks (an audio span cut across chunks), prefilled side by side and
    between another's decode steps, the third in a slot the first two left, answer as generate() does on the
    whole prompt."""
    models, thinker = chunked_engine.models, chunked_engine.stage("thinker")
    prompts = [LONG_PROMPT, PROMPTS["audio"], PROMPTS["text"]]
    lengths = [len(models.encoder.encode(m).input_ids) for m in prompts]
    assert min(lengths) > 16 and max(lengths) > 3 * 16
    refs = [reference_generate(reference_model, models.encoder.encode(m)) for m in prompts]
    prefills = thinker.counters.num_steps - thinker.counters.num_decode_steps
    with CodecTap(chunked_engine) as tap:
        outs = await asyncio.gather(*(engine_generate(chunked_engine, f"chunked-{i}", m, tap=tap)
                                      for i, m in enumerate(prompts)))
    for ref, out, n in zip(refs, outs, lengths, strict=True):
        assert_same_reply(chunked_engine, ref, out)
        assert out.finished.usage.prompt_tokens == n
    prefilled = sum(lengths) - sum(out.finished.usage.cached_tokens for out in outs)
    assert thinker.counters.num_steps - thinker.counters.num_decode_steps - prefills >= -(-prefilled // 16) > 3


def test_streaming_chunks_join_without_gap(engine):
    """Any chunking of any code sequence reproduces the one-shot decode: no missing or repeated samples; exact
    while the context holds the whole history (longer sequences: test_vocoder_parity.py)."""
    from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 64, size=(61, 16)).tolist()
    full = engine.models.code2wav.decode_full(frames)
    for initial, chunk, ctx in [(4, 12, 72), (2, 5, 100), (1, 25, 25), (3, 7, 1)]:
        stream = CodecStream.fixed(initial, chunk, ctx, frames=list(frames), input_done=True)
        pieces = []
        while not stream.is_drained():
            window, n = stream.next_window()
            pieces.append(engine.models.code2wav.decode([window])[0])
            stream.advance(n)
        out = np.concatenate(pieces)
        assert len(out) == len(full), (initial, chunk, ctx)
        tol = 1e-4 if ctx >= len(frames) else 0.05  # a shorter context only approximates the history
        assert np.abs(out - full).max() < tol, (initial, chunk, ctx)


MULTI_TURN = [{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": [{"type": "audio", "audio": _noise(6000, 7)},
                                           {"type": "text", "text": "First question."}]},
              {"role": "assistant", "content": "A first answer."},
              {"role": "user", "content": [{"type": "audio", "audio": _audio_1s()}]}]


def _generates_talker_input(hf, ids: list[int], embeds: torch.Tensor, hidden: torch.Tensor, speaker: int):
    """The talker input transformers' generate() builds from Thinker rows (`embeds` [P + 1, H]: the prompt's
    rows, then the first reply token's; `hidden` [P, H] the tapped layer), as its `generate()` does."""
    cfg, n = hf.config, len(ids)
    ids_t = torch.tensor([ids])
    mm = torch.isin(ids_t, torch.tensor([cfg.thinker_config.audio_token_id, cfg.thinker_config.image_token_id,
                                         cfg.thinker_config.video_token_id]))
    user_rows = hf._get_talker_user_parts(0, n, mm, hidden[None], embeds[None, :n])[0]
    starts = [i for i in range(n) if ids[i] == cfg.im_start_token_id]
    roles = [ids[starts[max(k for k, s in enumerate(starts) if s <= i)] + 1] if starts and i >= starts[0] else -1
             for i in range(n)]
    user = [i for i in range(n) if roles[i] == cfg.user_token_id]
    special = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]])
    bos, eos, pad = hf.talker.text_projection(hf.thinker.get_input_embeddings()(special)).chunk(3, dim=1)
    assistant = max(i for i in range(n - 1) if ids[i] == cfg.im_start_token_id
                    and ids[i + 1] == cfg.assistant_token_id)
    head, _, _ = hf._get_talker_assistant_parts(assistant, n + 1, speaker, embeds[None], pad, bos, eos)
    return torch.cat([user_rows[user], head[0]])


def test_talker_prompts_built_in_one_batch_are_generates_talker_inputs(engine, reference_model):
    """A step's new Talker prompts, built together (`TalkerModel.prepare`: one projection per kind of row, one
    gather), are the talker inputs that transformers' generate() builds for each alone from the same Thinker
    rows (text, audio, and a second turn after an assistant reply; Thinker rows arriving in two chunks)."""
    from omnirt.pipeline.models.qwen3_omni.talker import TalkerState
    from omnirt.pipeline.models.qwen3_omni.thinker import ThinkerRows

    models, gen = engine.models, torch.Generator().manual_seed(0)
    talker, width = models.talker, reference_model.config.thinker_config.text_config.hidden_size
    states, expected = [], []
    for messages in (PROMPTS["text"], PROMPTS["audio"], MULTI_TURN):
        prompt = models.encoder.encode(messages)
        n = len(prompt.input_ids)
        embeds, hidden = torch.randn(n + 1, width, generator=gen), torch.randn(n, width, generator=gen)
        st = TalkerState(models.voices["ethan"], prompt.input_ids, prompt.audio_lengths, None)
        for part in (slice(0, n // 2), slice(n // 2, n)):
            st.add(ThinkerRows(prompt_embeds=embeds[part], prompt_hidden=hidden[part]))
        st.add(ThinkerRows(token_embed=embeds[n]))
        assert talker.plan_prompt(st) == len(st.user_positions) + 9
        states.append(st)
        expected.append(_generates_talker_input(reference_model, prompt.input_ids, embeds, hidden,
                                                models.voices["ethan"]))
    with torch.inference_mode():
        talker.prepare([dataclasses.make_dataclass("Req", ["state"])(st) for st in states])
    for st, want in zip(states, expected, strict=True):
        torch.testing.assert_close(st.prompt, want)
        assert torch.equal(st.position_ids, torch.arange(len(want)).expand(3, -1))


def test_rope_positions_without_images_are_get_rope_indexs(engine, reference_model):
    """Text and audio prompts take the plain positions without calling `get_rope_index` (whose host round trips
    made each new turn wait for the stage's stream): they are what it gives."""
    from omnirt.pipeline.models.qwen3_omni.rope import rope_positions

    model = reference_model.thinker.model
    for messages in (PROMPTS["text"], PROMPTS["audio"], MULTI_TURN):
        prompt = engine.models.encoder.encode(messages)
        ids = torch.tensor([prompt.input_ids])
        want, delta = model.get_rope_index(ids, None, None, torch.ones_like(ids), False, prompt.audio_lengths, None)
        got, offset = rope_positions(model, prompt.input_ids, prompt.audio_lengths, None, torch.device("cpu"))
        assert torch.equal(got, want[:, 0].long()) and offset == int(delta.flatten()[0]) == 0
