"""Teacher forcing through the served path, and the full-size parity check's own machinery on the tiny model
(fp32): forced tokens are emitted as given, the logits the engine hands back are transformers' on the same
prefix, the bound passes the engine and fails a broken one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnirt.loadtest.gpu import hf_parity

TINY = ["--model", "tiny", "--dtype", "float32", "--threads", "1"]


@pytest.fixture(scope="module")
def built():
    from omnirt.app.cli import build_parser, engine_options
    from omnirt.pipeline.serving.core import build_engine

    with hf_parity.pristine_code2wav() as kept:
        engine = build_engine(engine_options(build_parser().parse_args(["serve", *TINY])))
    engine.pristine = kept[0]  # transformers' own Code2Wav, before the engine re-expressed its convolutions
    yield engine
    engine.stop()


def test_forced_tokens_are_emitted_and_their_logits_are_transformers_on_that_prefix(built):
    """Off the greedy path (tokens and codes of no reply's own choosing): the engine emits them, and each Thinker
    step's logits equal one transformers forward over the prompt and the forced tokens before it."""
    models, tap = built.models, hf_parity.Tap(built)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    rng = np.random.default_rng(1)
    eos = set(models.thinker.eos_ids)
    special = eos | {models.thinker.tool_call_id}
    tokens = [int(t) for t in rng.integers(10, models.thinker.vocab_size, 24) if int(t) not in special][:16]
    codebook = models.hf.config.talker_config.code_predictor_config.vocab_size
    frames = rng.integers(0, min(codebook, models.talker.vocab_size - 1024), (8, models.talker.num_groups)).tolist()
    forced = hf_parity.Reply(tokens, frames, [], [], [])
    ours = asyncio.run(hf_parity.serve(built, tap, "forced-off-path", messages, len(tokens), len(frames), forced))
    assert ours.tokens == tokens and ours.frames == frames

    prompt = models.encoder.encode(messages)
    ids = torch.tensor([prompt.input_ids + tokens[:-1]])
    with torch.inference_mode():
        logits = models.hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    ref = list(logits[len(prompt.input_ids) - 1:].float())
    assert len(ours.thinker) == len(ref) == len(tokens)
    result = hf_parity.compare(ours.thinker, ref, hf_parity.bounds(models, messages, built.pristine)["thinker"])
    assert result["pass"] and result["top1_agree"] == 1.0, result
    assert len(ours.talker) == len(frames) + 1 and len(ours.codebooks) == len(frames)
    assert all(c.shape == (models.talker.num_groups - 1, codebook) for c in ours.codebooks)


def test_the_check_passes_the_engine_and_fails_a_broken_attention(built):
    args = SimpleNamespace(prompts=3, tokens=8, frames=8, control_prompts=2, break_scales="2.0 1.02", budget_s=1e9)
    out = asyncio.run(hf_parity.check(built, built.pristine, args))
    assert out["pass"] and out["prompts"] == 3 and out["forced_pass"] == 3 and out["enough_steps"]
    for stage in ("thinker", "talker", "code_predictor"):
        assert out[stage]["top1_agree"] == 1.0 and out[stage]["worst_ratio"] <= 1.0, (stage, out[stage])
    assert out["code2wav"]["failed_prompts"] == 0
    assert out["free_running_text_equal"] == out["free_running_frames_equal"] == 3
    control = out["negative_control"]
    assert control["caught"] and min(control["worst_ratio"]) > 100  # far past the bound, not near it
    assert out["sensitivity"]["attention scale x1.02"]["caught"]  # in float32 even a 2% break is far past it
    assert out["sensitivity"]["experts 0 and 1 swapped"]["caught"]

    # the weights are back as they were (every break undone): the same forced request passes again;
    # transformers' experts implementation, set for the reference, is the engine's again everywhere
    configs = hf_parity.experts_configs(built.models.hf)
    before = [c._experts_implementation_internal for c in configs]
    ref = hf_parity.reference(built.models, hf_parity.prompts()[0], 8, 8)
    assert [c._experts_implementation_internal for c in configs] == before and len(configs) > 3
    again = asyncio.run(hf_parity.serve(built, hf_parity.Tap(built), "after-control", hf_parity.prompts()[0], 8, 8,
                                        ref))
    wavs = hf_parity.code2wav_references(built.pristine, built.models.code2wav, again)
    assert hf_parity.forced_result(again, ref, hf_parity.bounds(built.models, hf_parity.prompts()[0], built.pristine),
                                   wavs)["pass"]


def test_the_bound_is_stated_from_the_dtype_and_the_layers():
    models = SimpleNamespace(hf=SimpleNamespace(
        thinker=SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16))),
        config=SimpleNamespace(
            thinker_config=SimpleNamespace(text_config=SimpleNamespace(num_hidden_layers=48, hidden_size=2048),
                                           vision_config=SimpleNamespace(depth=27),
                                           audio_config=SimpleNamespace(encoder_layers=32)),
            talker_config=SimpleNamespace(
                accept_hidden_layer=24, text_config=SimpleNamespace(num_hidden_layers=20, hidden_size=1024),
                code_predictor_config=SimpleNamespace(num_hidden_layers=5, hidden_size=1024))),
    ))
    code2wav = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    text = hf_parity.bounds(models, [{"role": "user", "content": "hi"}], code2wav)
    assert text["thinker"].unit == 2 ** -8 + 2 ** -24 * 2048 ** 0.5 and text["thinker"].roundings == 6 * 48
    assert text["talker"].roundings == 6 * 44 and text["code_predictor"].roundings == 6 * 49
    assert text["code2wav"].roundings == 2
    audio = hf_parity.bounds(models, [{"role": "user", "content": [{"type": "audio", "audio": np.zeros(1)}]}],
                             code2wav)
    assert audio["thinker"].roundings == 6 * (48 + 33)
    assert text["thinker"].rel == pytest.approx(text["thinker"].unit * (6 * 48 + 1) ** 0.5)


def test_a_difference_past_the_bound_fails_and_one_within_passes():
    b = hf_parity.Bound(2 ** -8, 6 * 48)
    rng = torch.Generator().manual_seed(0)
    ref = [torch.randn(1000, generator=rng) * 3 for _ in range(4)]
    noise = [r * (1 + 0.5 * b.rel * torch.randn(1000, generator=rng)) for r in ref]  # half the bound's rms
    assert hf_parity.compare(noise, ref, b)["pass"]
    assert not hf_parity.compare([r * (1 + 2 * b.rel) for r in ref], ref, b)["pass"]  # twice the bound's rms
    spike = [r.clone() for r in ref]
    spike[2][7] += 10 * hf_parity.Z * b.rel * 3
    out = hf_parity.compare(spike, ref, b)
    assert not out["pass"] and out["worst_step"] == 2


def test_the_prompts_cover_text_audio_images_and_conversations():
    kinds = [hf_parity._kind(m) for m in hf_parity.prompts()]
    assert len(kinds) >= 16
    assert {"text", "text-turns", "audio", "audio-turns", "image", "image-turns"} <= set(kinds)


def test_a_prompt_that_raises_is_a_failed_row_and_the_rest_go_on(built, monkeypatch):
    reference = hf_parity.reference

    def flaky(models, messages, tokens, frames):
        if "about the sea" in str(messages):  # prompt 1
            raise RuntimeError("out of memory (a test's)")
        return reference(models, messages, tokens, frames)

    monkeypatch.setattr(hf_parity, "reference", flaky)
    args = SimpleNamespace(prompts=3, tokens=4, frames=4, control_prompts=2, break_scales="2.0", budget_s=1e9)
    out = asyncio.run(hf_parity.check(built, built.pristine, args))
    assert out["prompts"] == 3 and out["forced_pass"] == 2 and not out["pass"]
    assert out["errors"] == ["prompt 1: RuntimeError: out of memory (a test's)"]
    assert out["negative_control"]["caught"] and len(out["negative_control"]["worst_ratio"]) == 2


def test_a_free_running_parting_is_told_with_both_sides_margins_there():
    def rows(*values: dict[int, float]) -> list[torch.Tensor]:  # one row of logits per step
        out = []
        for v in values:
            row = torch.zeros(6)
            row[list(v)] = torch.tensor(list(v.values()), dtype=torch.float32)
            out.append(row)
        return out

    # transformers chose 4 at step 2 (by 0.5 over 3); the engine, fed the same prefix, favours 3 by 0.25
    ref = hf_parity.Reply([1, 2, 4], [[0] * 16, [5] * 16], rows({1: 1}, {2: 1}, {4: 1.5, 3: 1.0}),
                          rows({0: 1}, {5: 1.0, 3: 0.75}), [])
    forced = hf_parity.Reply([1, 2, 4], [], rows({1: 1}, {2: 1}, {3: 1.25, 4: 1.0}), rows({0: 1}, {3: 1.0, 5: 0.5}),
                             [])
    free = hf_parity.Reply([1, 2, 3], [[0] * 16, [3] * 16], [], [], [])
    out = hf_parity.free_result(free, ref, forced)
    assert out["text_parts_at"] == 2 and out["text_margins"] == {"engine": 0.25, "reference": 0.5}
    assert out["first_code_parts_at"] == 1 and out["first_code_margins"] == {"engine": 0.5, "reference": 0.25}
    assert not out["frames_equal"]
    same = hf_parity.free_result(ref, ref, forced)
    assert same["text_parts_at"] is None and same["text_margins"] is None and same["frames_equal"]
