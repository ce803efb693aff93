"""Compiled decode steps (torch.compile before capture) on the CPU: the tiny engine with every decode step
compiled and attention reading the slot cache in place gives transformers' generate() output, and what
was compiled for one workload serves the same workload again without compiling anything."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pipeline.api import OmniRequest, collect_reply
from pipeline.compile import TimedStep
from tests.test_attention import cpu_only
from tests.test_parity import assert_greedy_parity, started_engine


@pytest.fixture(scope="module")
def compiled_engine(tiny_config):
    with started_engine(dataclasses.replace(tiny_config, attention="slots", compile="on")) as eng:
        yield eng


def _steps(engine) -> list[TimedStep]:
    m = engine.models
    return [g.fn for g in (m.thinker.graphs, m.talker.decode_graphs, m.talker.predictor_graphs)]


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
    sizes = [b for s in compiled_engine.stages[:2] for b, n in enumerate(s.batch_size_counts) if n]
    assert 1 in sizes and max(sizes) >= 4  # the steps did run at several batch sizes
    assert all(n > 0 for n in compiled[0]) and compiled[1] == compiled[0]


def test_compile_setting(tiny_config):
    from pipeline.config import ProfileError, build_config

    raw = {"model": "tiny", "stages": [{"stage_id": 0, "enforce_eager": False}]}
    cfg = build_config({**raw, "compile": False}, "cuda", {}, {})  # YAML reads `compile: off` as False
    assert cfg.compile == "off" and not cfg.compiles("thinker", graphs=True)
    auto = build_config(raw, "cuda", {}, {})
    assert auto.compiles("thinker", graphs=True) and not auto.compiles("talker", graphs=True)  # talker eager
    assert not auto.compiles("thinker", graphs=False)  # auto follows the graphs
    assert build_config({**raw, "compile": True}, "cpu", {}, {}).compiles("talker", graphs=False)
    with pytest.raises(ProfileError, match="compile"):
        build_config({**raw, "compile": "sometimes"}, "cuda", {}, {})
