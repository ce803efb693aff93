"""Compiled decode steps (torch.compile before capture) on the CPU: the tiny engine with every decode step
compiled and attention reading the slot cache in place gives transformers' generate() output, and what
was compiled for one workload serves the same workload again without compiling anything."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.decoder import prefill_buckets, run_decoder
from omnirt.pipeline.stage.compile import TimedStep
from omnirt.pipeline.stage.cudagraph import bucket_for
from tests.test_attention import cpu_only
from tests.test_parity import assert_greedy_parity, started_engine


@pytest.fixture(scope="module")
def compiled_engine(tiny_config):
    """Every decode step compiled; Code2Wav's decoder not (compiling the whole vocoder takes minutes on the
    CPU: tests/test_code2wav_fast.py has it once)."""
    stages = list(tiny_config.stages)
    stages[2] = dataclasses.replace(stages[2], compile="off")
    cfg = dataclasses.replace(tiny_config, attention="slots", compile="on", stages=tuple(stages))
    with started_engine(cfg) as eng:
        assert not eng.models.code2wav.is_compiled
        yield eng


def _steps(engine) -> list[TimedStep]:
    m = engine.models
    return [g.fn for g in (m.thinker.cuda_graphs, m.talker.decode_graphs, m.talker.predictor_graphs)]


@cpu_only
@pytest.mark.parametrize("kind", ["text", "audio"])
async def test_compiled_engine_matches_transformers_generate(compiled_engine, reference_model, kind):
    assert all(isinstance(step, TimedStep) for step in _steps(compiled_engine))
    assert compiled_engine.models.thinker.decode_layers is not None  # the layers that run are compiled ones
    await assert_greedy_parity(compiled_engine, reference_model, f"compiled-{kind}", kind)


@cpu_only
async def test_compiled_once_then_served(compiled_engine):
    """Requests of different lengths, together (the decode batches shrink from 5 rows to 1 as they end),
    twice: the second round finds every shape compiled."""
    def request(i: int) -> OmniRequest:
        return OmniRequest(f"batch-{i}", [{"role": "user", "content": "hello " * (i + 1)}], ("text", "audio"),
                           thinker_sampling={"temperature": 0.0, "max_tokens": 4 + 3 * i, "min_tokens": 4 + 3 * i},
                           talker_sampling={"temperature": 0.0, "max_tokens": 6 + 4 * i, "min_tokens": 6 + 4 * i})

    async def reply(i: int):
        return await collect_reply(await compiled_engine.submit(request(i)))

    compiled = []
    for _ in range(2):
        replies = await asyncio.gather(*(reply(i) for i in range(5)))
        assert [len(r.token_ids) for r in replies] == [4 + 3 * i for i in range(5)]
        assert all(r.finished.error is None and r.pcm16 for r in replies)
        compiled.append([step.num_compiles for step in _steps(compiled_engine)])
    sizes = [b for s in compiled_engine.stages[:2] for b, n in enumerate(s.counters.batch_size_counts) if n]
    assert 1 in sizes and max(sizes) >= 4  # the steps did run at several batch sizes
    assert all(n > 0 for n in compiled[0]) and compiled[1] == compiled[0]


@cpu_only
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_prefill_runs_the_compiled_layers_and_never_compiles(compiled_engine, stage):
    """After start-up (which warmed the prefill shapes), chunks of shapes no warm-up ran (one row of one token,
    five ragged rows) run inductor's code for the layers, compile nothing, and give the eager layers' rows."""
    from torch.profiler import profile

    from omnirt.pipeline.stage.compile import graphs_compiled

    model = getattr(compiled_engine.models, stage)
    prefill, kv = model.prefill, model.kv
    hidden = model.stack.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    before = graphs_compiled()
    for lengths in ([1], [7, 1, 3, 12, 2], [40, 9]):
        slots = list(range(len(lengths)))
        rows = [torch.randn(n, hidden, generator=gen) for n in lengths]
        positions = [torch.arange(n).expand(3, -1) for n in lengths]
        with torch.inference_mode():
            embeds, pos, view = prefill.inputs(slots, [0] * len(lengths), lengths, rows, positions)
            assert embeds.shape[:2] == (max(2, len(lengths)), max(2, *lengths))  # padded past dynamo's 1s
            with profile() as prof:
                served, _ = run_decoder(prefill.stack, embeds, pos, view, layers=prefill.layers)
            eager, _ = run_decoder(prefill.stack, embeds, pos, kv.view(slots, [0] * len(lengths), lengths,
                                                                        embeds.shape[1]))
        assert any("CompiledFxGraph" in e.name for e in prof.events())  # inductor's code ran, not the modules
        for i, n in enumerate(lengths):
            torch.testing.assert_close(served[i, :n], eager[i, :n], rtol=1e-4, atol=1e-4)
    assert graphs_compiled() == before


def test_compile_setting(tiny_config):
    from omnirt.pipeline.config import ProfileError
    from tests.profiles import build_config

    raw = {"model": "tiny", "stages": [{"stage_id": 0, "enforce_eager": False}]}
    cfg = build_config({**raw, "compile": False}, "cuda", {}, {})  # YAML reads `compile: off` as False
    assert cfg.compile == "off" and not cfg.compiles("thinker", graphs=True)
    auto = build_config(raw, "cuda", {}, {})
    assert auto.compiles("thinker", graphs=True) and not auto.compiles("talker", graphs=True)  # talker eager
    assert not auto.compiles("thinker", graphs=False)  # auto follows the graphs
    assert build_config({**raw, "compile": True}, "cpu", {}, {}).compiles("talker", graphs=False)
    with pytest.raises(ProfileError, match="compile"):
        build_config({**raw, "compile": "sometimes"}, "cuda", {}, {})


def test_a_stages_own_compile_setting_and_the_conv_backend(tiny_config):
    """A stage's `compile` is over the engine's (YAML's bare off included); `--enforce-eager` turns every
    stage's off whatever it says; `conv_backend` is checked against the formulations there are."""
    from omnirt.pipeline.api import EngineOptions
    from omnirt.pipeline.config import ProfileError
    from tests.profiles import build_config, engine_config

    raw = {"model": "tiny", "stages": [{"stage_id": 0, "enforce_eager": False}, {"stage_id": 2, "enforce_eager": False,
                                                                                 "compile": False}]}
    cfg = build_config(raw, "cuda", {}, {})
    assert cfg.compiles("thinker", graphs=True) and not cfg.compiles("code2wav", graphs=True)
    on = build_config(raw, "cuda", {}, {"2": {"compile": "on"}})
    assert on.compiles("code2wav", graphs=False)
    with pytest.raises(ProfileError, match=r"stages\[2\].compile must be one of auto, on, off"):
        build_config(raw, "cuda", {}, {"2": {"compile": "maybe"}})
    profile = "omnirt/deploy/qwen3_omni_moe_1gpu.yaml"
    served = engine_config(EngineOptions(model="qwen3-omni-30b-a3b", deploy_config=profile), "cuda")
    # the shipped profile: graphs of the uncompiled Code2Wav with its Triton convolutions
    # (docs/lab/2026-12-02-host-path-code2wav-async.md)
    assert not served.stage("code2wav").enforce_eager and not served.compiles("code2wav", graphs=True)
    assert served.conv_backend == "triton"
    on_cpu = engine_config(EngineOptions(model="qwen3-omni-30b-a3b", deploy_config=profile), "cpu")
    assert on_cpu.conv_backend == "native"
    compiled = engine_config(EngineOptions(model="qwen3-omni-30b-a3b", deploy_config=profile,
                                           stage_overrides={"2": {"compile": "on"}}), "cuda")
    assert compiled.compiles("code2wav", graphs=True) and not compiled.stage("code2wav").enforce_eager
    assert served.connector.codec_chunk_pacing == "adaptive"
    eager = engine_config(EngineOptions(model="qwen3-omni-30b-a3b", deploy_config=profile, enforce_eager=True,
                                        stage_overrides={"2": {"compile": "on"}}), "cuda")
    assert not any(eager.compiles(name, graphs=True) for name in ("thinker", "talker", "code2wav"))
    gemm = engine_config(EngineOptions(deploy_config=profile, model="x", settings=("conv_backend=gemm",)), "cuda")
    assert gemm.conv_backend == "gemm"
    with pytest.raises(ProfileError, match="conv_backend must be one of native, gemm, channels_last, triton"):
        build_config({**raw, "conv_backend": "winograd"}, "cuda", {}, {})


def _chunks(model, lengths: list[int], starts: list[int], gen: torch.Generator):
    """Stage requests as `PrefillPass.run` reads them: slots 0.., random rows, multimodal-shaped positions."""
    from types import SimpleNamespace

    hidden, total = model.stack.config.hidden_size, max(s + n for s, n in zip(starts, lengths))
    return [SimpleNamespace(slot=i, state=SimpleNamespace(rows=torch.randn(total, hidden, generator=gen),
                                                          position_ids=torch.arange(total).expand(3, -1) + i))
            for i in range(len(lengths))]


def test_prefill_buckets_step_by_half_past_sixteen_within_the_token_budget():
    """A chunk batch of 29 first turns of 142 tokens (c=64 in the 1-GPU profile) pads to 32 x 192, where powers of
    two alone padded it to 32 x 256; no bucket exceeds the token budget or the model length."""
    rows, widths = prefill_buckets(64, 2048, 8192)
    assert rows == [2, 4, 8, 16, 24, 32, 48, 64]
    assert widths[:8] == [2, 4, 8, 16, 32, 64, 96, 128] and widths[-1] == 2048
    assert (bucket_for(29, rows), bucket_for(142, widths)) == (32, 192)
    assert (bucket_for(40, rows), bucket_for(700, widths)) == (48, 768)
    assert all(w <= 2048 and w * 2 <= 8192 for w in widths)
    assert prefill_buckets(4, 64, 64) == ([2, 4], [2, 4, 8, 16, 32])
    assert prefill_buckets(64, 2048, 3) == ([], [])


@cpu_only
@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_prefill_graphs_replay_the_padded_step_as_the_ragged_batch(compiled_engine, stage):
    """Prefill graphs, captured on a stand-in platform whose graph replays the step on its static inputs (a
    CUDA graph replays the kernels the step issued): a batch padded to its (rows, width) bucket gives each
    chunk's last row, the tapped rows and the slots' keys and values of the ragged batch, and its padding
    writes nothing but the scratch slot."""
    from omnirt.pipeline.models.decoder import PrefillPass
    from tests.test_cudagraph import _FakeGraphPlatform

    model = getattr(compiled_engine.models, stage)
    served, kv = model.prefill, model.kv
    graphs = PrefillPass("test", served.stack, kv, served.compiled, _FakeGraphPlatform(), graphs=True, max_rows=4,
                         max_tokens=64, tap_layer=served.tap_layer)
    assert graphs.cuda_graphs.keys == [(b, w) for b in (2, 4) for w in (2, 4, 8, 16, 32) if b * w <= 64]
    with torch.inference_mode():
        graphs.capture(None)
    step = graphs._graph_step
    for key, c in graphs.cuda_graphs._graphs.items():
        c.graph.replay = lambda c=c, k=key: [o.copy_(n) for o, n in zip(c.outputs, step(k[1], **c.inputs))]
    gen = torch.Generator().manual_seed(1)
    lengths, starts = [3, 7, 1], [0, 5, 2]
    reqs = _chunks(model, lengths, starts, gen)
    assert graphs.cuda_graphs.holds(3, 7) and not graphs.cuda_graphs.holds(3, 40)
    before = (kv.k.clone(), kv.v.clone())
    with torch.inference_mode():
        last, tapped = served.run(reqs, starts, lengths, "rows")  # the CPU's own pass: no graphs, ragged
        ragged = (kv.k.clone(), kv.v.clone())
        kv.k.copy_(before[0]), kv.v.copy_(before[1])
        replays = graphs.cuda_graphs.num_replays
        g_last, g_tapped = graphs.run(reqs, starts, lengths, "rows")
    assert graphs.cuda_graphs.num_replays == replays + 1 and g_last.shape == last.shape
    torch.testing.assert_close(g_last, last, rtol=1e-4, atol=1e-4)
    if stage == "thinker":
        for i, n in enumerate(lengths):
            torch.testing.assert_close(g_tapped[i, :n], tapped[i, :n], rtol=1e-4, atol=1e-4)
    else:
        assert tapped is None and g_tapped is None
    scratch = kv.scratch_slot
    for buf, want in zip((kv.k, kv.v), ragged):
        torch.testing.assert_close(buf[:, :scratch], want[:, :scratch], rtol=1e-4, atol=1e-4)
    changed = [s for s in range(scratch) if not torch.equal(kv.k[:, s], before[0][:, s])]
    assert changed == [0, 1, 2]  # the chunks' own slots, nothing else
