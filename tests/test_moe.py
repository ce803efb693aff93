"""The fused Triton MoE experts (`omnirt/pipeline/kernels/moe.py`, under Triton's interpreter on the CPU): the alignment
of (token, expert) pairs into blocks, the kernels against transformers' eager experts on the Thinker's and
the Talker's experts modules, and the tiny engine with `moe_backend="triton"` against generate()."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from omnirt.pipeline.kernels import moe
from tests.test_attention import CUDA, cpu_only, on_cuda
from tests.test_parity import assert_greedy_parity, started_engine

DEVICE = "cuda" if CUDA else "cpu"
# compiled on a GPU (bf16 as served, and fp32); interpreted on the CPU (fp32: numpy has no bf16)
DTYPES = [(torch.float32, 1e-5), on_cuda(torch.bfloat16, 3e-2, id="bf16")]
EXPERTS = {"thinker": mods.Qwen3OmniMoeThinkerTextExperts, "talker": mods.Qwen3OmniMoeTalkerTextExperts}
SMALL_TILES = moe.Tiles(block_m=16, block_n=16, block_k=16)  # several column and reduction tiles at tiny sizes


def routing(kind: str, tokens: int, top_k: int, experts: int, g: torch.Generator) -> torch.Tensor:
    """top_k distinct experts per token, as a router picks them. random: any experts; hot: expert 0 in every
    row (more pairs than one block holds); few: only experts 1, 2, 5 (the others get none, every row repeats
    the same three)."""
    pool = {"random": torch.arange(experts), "hot": torch.arange(1, experts), "few": torch.tensor([1, 2, 5])}[kind]
    rows = [pool[torch.randperm(len(pool), generator=g)] for _ in range(tokens)]
    if kind == "hot":
        return torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), r[:top_k - 1]]) for r in rows])
    return torch.stack([r[:top_k] for r in rows])


def experts_module(kind: str, experts: int, top_k: int, dtype: torch.dtype, g: torch.Generator) -> torch.nn.Module:
    config = cfgs.Qwen3OmniMoeTextConfig(hidden_size=40, moe_intermediate_size=24, num_experts=experts,
                                         num_experts_per_tok=top_k)
    module = EXPERTS[kind](config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.to(DEVICE, dtype)


def run(module: torch.nn.Module, impl: str, *args: torch.Tensor) -> torch.Tensor:
    module.config._experts_implementation = impl
    with torch.inference_mode():
        return module(*args)


def inputs(kind: str, tokens: int, top_k: int, experts: int, dtype: torch.dtype, seed: int):
    """Fresh hidden states, routing and normalised routing weights."""
    g = torch.Generator().manual_seed(seed)
    index = routing(kind, tokens, top_k, experts, g)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    hidden = torch.randn(tokens, 40, generator=g)
    return g, hidden.to(DEVICE, dtype), index.to(DEVICE), (weights / weights.sum(1, keepdim=True)).to(DEVICE, dtype)


@pytest.mark.fast
@pytest.mark.parametrize("tokens,top_k,experts,kind,block_m", [
    (1, 8, 128, "random", 16),  # a Thinker decode row
    (7, 6, 128, "random", 16),  # Talker-like
    (40, 3, 8, "hot", 16),  # expert 0 takes 40 pairs: three blocks
    (9, 3, 8, "few", 32),  # five experts hit by none
    (50, 4, 6, "random", 16),  # more pairs than the align kernel's chunk; experts not a power of two
])
def test_align_puts_each_pair_once_in_a_block_of_its_expert(tokens, top_k, experts, kind, block_m):
    index = routing(kind, tokens, top_k, experts, torch.Generator().manual_seed(tokens)).to(DEVICE)
    sorted_ids, block_expert, total = (t.cpu().long() for t in moe.align(index, experts, block_m))
    pairs, flat = tokens * top_k, index.flatten().cpu()
    counts = torch.bincount(flat, minlength=experts)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = sorted_ids[:int(total)]
    assert sorted(rows[rows < pairs].tolist()) == list(range(pairs))
    assert int((rows == pairs).sum()) == int(total) - pairs  # the rest is padding
    blocks = block_expert[:int(total) // block_m]
    assert blocks.tolist() == sorted(blocks.tolist())  # experts in order
    for b, expert in enumerate(blocks.tolist()):
        real = rows[b * block_m:(b + 1) * block_m]
        real = real[real < pairs]
        assert len(real) > 0 and (flat[real] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # each expert's pairs in pair order


@pytest.mark.fast
@pytest.mark.parametrize("module_kind,tokens,top_k,experts,routing_kind", [
    ("thinker", 1, 3, 8, "random"),
    ("thinker", 5, 3, 8, "random"),
    ("thinker", 17, 3, 8, "hot"),  # 17 rows for expert 0: two blocks of it
    ("thinker", 9, 3, 16, "few"),  # most experts hit by none; the same three in every row
    ("talker", 4, 6, 8, "random"),
])
@pytest.mark.parametrize("tiles", [moe.DECODE_TILES, SMALL_TILES], ids=["decode", "small"])
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_fused_experts_match_transformers_eager(module_kind, tokens, top_k, experts, routing_kind, tiles, dtype,
                                                atol):
    g, hidden, index, weights = inputs(routing_kind, tokens, top_k, experts, dtype, tokens * 31 + experts)
    module = experts_module(module_kind, experts, top_k, dtype, g)
    # the truth: eager in fp32 on the same (rounded) weights; eager bf16 rounds more than the kernels do
    ref = run(copy.deepcopy(module).float(), "eager", hidden.float(), index, weights.float())
    with torch.inference_mode():
        out = moe.fused_experts(hidden, module.gate_up_proj, module.down_proj, index, weights, tiles=tiles)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert torch.allclose(out.float(), ref, atol=atol), float((out.float() - ref).abs().max())
    assert ref.abs().max() > 10 * atol  # not a comparison of zeros


@pytest.mark.fast
def test_registered_forward_reads_the_modules_layout():
    """Through transformers' experts interface, and with the weights transposed ([E, K, N])."""
    g, hidden, index, weights = inputs("random", 6, 3, 8, torch.float32, 7)
    module = experts_module("thinker", 8, 3, torch.float32, g)
    ref = run(module, "eager", hidden, index, weights)
    assert torch.allclose(run(module, moe.use_fused_experts(), hidden, index, weights), ref, atol=1e-5)
    with torch.inference_mode():
        out = moe.fused_experts(hidden, module.gate_up_proj.transpose(1, 2).contiguous(),
                                module.down_proj.transpose(1, 2).contiguous(), index, weights, transposed=True)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.fast
def test_other_expert_layouts_are_refused():
    g, hidden, index, weights = inputs("random", 2, 3, 8, torch.float32, 3)
    module = experts_module("thinker", 8, 3, torch.float32, g)
    module.act_fn = torch.nn.GELU()
    with pytest.raises(NotImplementedError, match="SiLU"):
        run(module, moe.use_fused_experts(), hidden, index, weights)


@pytest.mark.fast
def test_long_prefill_chunks_go_to_grouped_mm(monkeypatch):
    tokens = moe.MAX_FUSED_PAIRS // 3 + 1
    g, hidden, index, weights = inputs("random", tokens, 3, 8, torch.float32, 5)
    module = experts_module("thinker", 8, 3, torch.float32, g)
    ref = run(module, "eager", hidden, index, weights)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernels ran past MAX_FUSED_PAIRS")

    monkeypatch.setattr(moe, "fused_experts", refuse)
    assert torch.allclose(run(module, moe.use_fused_experts(), hidden, index, weights), ref, atol=1e-4)


@pytest.mark.fast
def test_moe_backend_choice(monkeypatch):
    import omnirt.pipeline.models.qwen3_omni.models as models
    from omnirt.pipeline.config import EngineConfig, ProfileError
    from omnirt.pipeline.platform import Platform

    cpu, gpu = Platform("cpu", "cpu", "gloo", False), Platform("cuda", "cpu", "nccl", True)
    assert models._experts("auto", cpu) == "eager" and models._experts("auto", gpu) == moe.NAME
    assert models._experts("triton", cpu) == moe.NAME and EngineConfig(moe_backend="triton").moe_backend == "triton"
    with pytest.raises(ProfileError, match="moe_backend"):
        EngineConfig(moe_backend="fused")
    monkeypatch.setattr(models, "available", lambda: False)
    assert models._experts("auto", gpu) == "grouped_mm"  # graphs without Triton
    with pytest.raises(ValueError, match="moe_backend: triton needs Triton"):
        models._experts("triton", gpu)


@pytest.fixture(scope="module")
def triton_engine(tiny_config):
    with started_engine(dataclasses.replace(tiny_config, moe_backend="triton")) as eng:
        yield eng


@cpu_only
@pytest.mark.parametrize("kind", ["text", "audio"])
async def test_engine_with_fused_experts_matches_transformers_generate(triton_engine, reference_model, kind,
                                                                       monkeypatch):
    models = triton_engine.models
    assert models.thinker.stack.config._experts_implementation == moe.NAME
    assert models.talker.stack.config._experts_implementation == moe.NAME
    calls = []
    fused = moe.fused_experts
    monkeypatch.setattr(moe, "fused_experts", lambda *a, **k: calls.append(len(a[0])) or fused(*a, **k))
    await assert_greedy_parity(triton_engine, reference_model, f"triton-{kind}", kind)
    assert 1 in calls and max(calls) > 1  # decode steps and the prompt's prefill both ran fused
