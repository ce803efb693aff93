"""Attention over the slot KV cache in place (the Triton kernel, under Triton's interpreter on the CPU):
the kernel against plain attention, a decoder stack against the dense-copy path, and the whole engine
against transformers' generate()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnirt.pipeline.kernels.attention import SlotMask, slot_attention
from tests.test_parity import PROMPTS, assert_greedy_parity, engine_generate, reference_generate, started_engine

CUDA = torch.cuda.is_available()


def on_cuda(*values, id: str, reason: str = "bf16 kernels are compiled on a CUDA device only (numpy has no bf16)"):
    """A parametrization that runs only where CUDA is: marked `gpu` (`make test-gpu` selects it), skipped with a
    reason elsewhere, so a CPU run counts it among its skips."""
    return pytest.param(*values, marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=reason)], id=id)


# compiled on a GPU (bf16 as served, and fp32); interpreted on the CPU (fp32: numpy has no bf16)
DTYPES = [(torch.float32, 1e-5), on_cuda(torch.bfloat16, 2e-2, id="bf16")]
# the tiny model's CPU runs need the interpreter, which conftest turns on only where there is no GPU
cpu_only = pytest.mark.skipif(CUDA, reason="runs the kernel on CPU tensors under Triton's interpreter")


def reference_attention(q, k_cache, v_cache, mask: SlotMask, scale: float) -> torch.Tensor:
    """Row by row: each real new token attends over its slot's keys [0, its position]."""
    b, heads, t, d = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(b, t, heads, d, dtype=torch.float32)
    for i in range(b):
        for j in range(int(mask.lengths[i])):
            end = int(mask.starts[i]) + j + 1
            k = k_cache[mask.slots[i], :, :end].float().repeat_interleave(group, 0)  # [heads, end, d]
            v = v_cache[mask.slots[i], :, :end].float().repeat_interleave(group, 0)
            weights = ((q[i, :, j, None, :].float() * k).sum(-1) * scale).softmax(-1)
            out[i, j] = (weights[..., None] * v).sum(1)
    return out


@pytest.mark.parametrize("batch,heads,kv_heads,new,head_dim", [
    (3, 8, 1, 1, 16),  # decode, a GQA group of 8 (the Thinker's and the Talker's ratio)
    (5, 16, 8, 2, 32),  # the code predictor's two-token first step, groups of 2
    (2, 4, 4, 5, 16),  # ragged prefill, no grouping
    (2, 4, 2, 70, 16),  # a prefill chunk over several query blocks and key tiles
])
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_kernel_matches_plain_attention(batch, heads, kv_heads, new, head_dim, dtype, atol):
    g = torch.Generator().manual_seed(batch * 100 + new)
    slots_total, max_len = 7, 256
    k_cache = torch.randn(slots_total, kv_heads, max_len, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_total, kv_heads, max_len, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, new, heads, head_dim, generator=g).to(dtype).transpose(1, 2)  # as transformers gives it
    mask = SlotMask(torch.randperm(slots_total, generator=g)[:batch], torch.randint(0, 150, (batch,), generator=g),
                    torch.randint(1, new + 1, (batch,), generator=g))
    ref = reference_attention(q, k_cache, v_cache, mask, head_dim ** -0.5)
    device = "cuda" if CUDA else "cpu"
    out = slot_attention(q.to(device), k_cache.to(device), v_cache.to(device),
                         SlotMask(*(x.to(device) for x in (mask.slots, mask.starts, mask.lengths))),
                         head_dim ** -0.5).float().cpu()
    real = torch.arange(new)[None, :] < mask.lengths[:, None]
    assert out.shape == (batch, new, heads, head_dim)
    assert torch.allclose(out[real], ref[real], atol=atol), float((out[real] - ref[real]).abs().max())
    assert not out[~real].any()  # padded rows of a chunk stay zero


@cpu_only
def test_decoder_stack_in_place_equals_the_dense_copy():
    """A prefill chunk then decode steps through the tiny Thinker's layers: the kernel reading the slots
    gives what transformers' SDPA over a dense copy gives."""
    from omnirt.pipeline.kernels.attention import attend_in_place
    from omnirt.pipeline.models.decoder import run_decoder
    from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model
    from omnirt.pipeline.stage.kv_cache import SlotKVCache

    hf, _, _ = load_hf_model("tiny", "auto", torch.float32, torch.device("cpu"))
    stack = hf.thinker.model.language_model
    c = stack.config
    attend_in_place(c)  # a bool mask (the dense view) still goes to SDPA
    caches = [SlotKVCache(c.num_hidden_layers, 4, c.num_key_value_heads, 64, c.head_dim, torch.float32, "cpu",
                          in_place) for in_place in (False, True)]
    g = torch.Generator().manual_seed(0)
    slots, starts, lengths = [2, 0], [0, 0], [9, 5]
    embeds = torch.randn(2, 9, c.hidden_size, generator=g)
    pos = torch.arange(9).expand(3, 2, 9)
    outs = []
    with torch.inference_mode():
        for kv in caches:
            steps = [run_decoder(stack, embeds, pos, kv.view(slots, starts, lengths))[0]]
            for n in range(4):
                positions = torch.tensor([9 + n, 5 + n])
                view = kv.dense_view(torch.tensor(slots), positions, 1, None if kv.in_place else 9 + n + 1)
                steps.append(run_decoder(stack, embeds[:, n:n + 1], positions.view(1, -1, 1).expand(3, -1, 1),
                                         view)[0])
            outs.append(steps)
    real = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]  # the chunk's padded rows are not compared
    assert torch.allclose(outs[0][0][real], outs[1][0][real], atol=1e-5)
    for dense, in_place in zip(outs[0][1:], outs[1][1:]):
        assert torch.allclose(dense, in_place, atol=1e-5)
    assert torch.allclose(caches[0].k, caches[1].k, atol=1e-5) and torch.allclose(caches[0].v, caches[1].v, atol=1e-5)


@pytest.fixture(scope="module")
def slots_engine(tiny_config):
    with started_engine(dataclasses.replace(tiny_config, attention="slots")) as eng:
        yield eng


@cpu_only
@pytest.mark.parametrize("kind", ["text", "audio"])
async def test_engine_with_slot_attention_matches_transformers_generate(slots_engine, reference_model, kind):
    models = slots_engine.models
    assert models.thinker.kv.in_place and models.talker.kv.in_place and models.talker.predictor_kv.in_place
    assert models.thinker.cuda_graphs.lengths is None  # one graph per batch size serves every length
    await assert_greedy_parity(slots_engine, reference_model, f"slots-{kind}", kind)


@cpu_only
async def test_slot_attention_starts_a_turn_from_the_slot_the_last_one_left(slots_engine, reference_model):
    """The second turn takes the first one's resident slot over (both stages) and prefills only what is
    new; the kernel reads the slot as it was left, and the answer is generate()'s on the whole prompt."""
    models = slots_engine.models
    tokens, _, _, _ = await engine_generate(slots_engine, "slots-turn-1", PROMPTS["text"])
    reply = models.tokenizer.decode(tokens, skip_special_tokens=True)
    messages = PROMPTS["text"] + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    ref_tokens, ref_frames, _ = reference_generate(reference_model, models.encoder.encode(messages))
    tokens, frames, _, fin = await engine_generate(slots_engine, "slots-turn-2", messages)
    assert fin.usage.cached_tokens >= len(models.encoder.encode(PROMPTS["text"]).input_ids)
    assert tokens == [t for t in ref_tokens if t not in models.thinker.eos_ids] and frames == ref_frames
    assert slots_engine.stage("talker").scheduler.prefix_stats().num_cached_tokens > 0


def test_auto_attention_is_dense_without_graphs():
    from omnirt.pipeline.models.qwen3_omni.models import _in_place
    from omnirt.pipeline.platform import Platform

    assert not _in_place("auto", Platform("cpu", "cpu", "gloo", False))
    assert _in_place("auto", Platform("cuda", "cpu", "nccl", True))  # Triton is installed for the tests
    assert not _in_place("dense", Platform("cuda", "cpu", "nccl", True))


def test_host_staging_splits_and_types():
    from omnirt.pipeline.stage.pinned import PinnedBuffers

    a, b, c = PinnedBuffers(torch.device("cpu")).tensors([1, 2, 3], [], [7])
    assert a.tolist() == [1, 2, 3] and b.numel() == 0 and c.tolist() == [7] and a.dtype == torch.long
    flags = PinnedBuffers(torch.device("cpu")).tensor([True, False], torch.bool)
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
    assert PinnedBuffers(torch.device("cpu")).fetch(torch.tensor([[3, 4], [5, 6]])) == [[3, 4], [5, 6]]


def test_host_staging_aligns_every_tensor():
    """Each staged tensor starts on 16 bytes (2 int64 values, 16 bools): a Triton kernel taking slots or lengths
    is specialised on that alignment, and a step whose rows landed elsewhere compiled it again while serving."""
    from omnirt.pipeline.stage.pinned import aligned_starts

    assert aligned_starts([3, 0, 2, 1], 2) == [0, 4, 4, 6, 8]
    assert aligned_starts([5, 16, 1], 16) == [0, 16, 32, 48]
    assert aligned_starts([], 2) == [0]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="pinned memory needs a CUDA device")
def test_host_staging_reuses_its_pinned_regions_round_robin():
    from omnirt.pipeline.stage.pinned import PinnedBuffers

    pinned = PinnedBuffers(torch.device("cuda"), capacity=8)
    first = pinned.tensors([1, 2, 3], [4, 5])
    torch.cuda.synchronize()  # a stage synchronizes once per step
    assert [t.tolist() for t in first] == [[1, 2, 3], [4, 5]]
    assert all(t.data_ptr() % 16 == 0 for t in first)
    second = pinned.tensor([6, 7, 8, 9])  # 6 (aligned) + 4 > 8: wraps to the start
    assert second.tolist() == [6, 7, 8, 9] and second.data_ptr() == first[0].data_ptr()
    big = pinned.tensor(list(range(20)))  # past the capacity: a plain copy
    assert big.tolist() == list(range(20))
    tokens = torch.randint(0, 1000, (64,), device="cuda")
    assert pinned.fetch(tokens) == tokens.tolist() and pinned.fetch(tokens[:3] * 2) == (tokens[:3] * 2).tolist()
