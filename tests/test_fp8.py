"""FP8 experts (`omnirt/pipeline/kernels/fp8.py`): block quantisation within e4m3's rounding bound, the fused Triton
kernels (its interpreter on the CPU) and the dequantising forward against the eager math on the weights the FP8
values stand for, the tiny Thinker's logits and the Talker's codec frames within a bound stated before measuring, and
the tiny engine with `quantization: fp8` against transformers' generate() on the dequantised weights."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import types
import weakref
from pathlib import Path

import pytest
import torch

from omnirt.loadtest.gpu.fp8_accuracy import (
    LAYER_BOUND,
    agree_where_decisive,
    frame_logits,
    greedy_frames,
    relative_rms,
    reverse_scales,
    reversed_blocks,
    teacher_forced,
)
from omnirt.pipeline.kernels import fp8, moe
from omnirt.pipeline.models.qwen3_omni import fp8_weights
from tests.test_attention import cpu_only
from tests.test_moe import DEVICE, SMALL_TILES, experts_module, inputs, run
from tests.test_parity import assert_greedy_parity, started_engine

# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself, a subnormal (spacing 2^-9) by
# at most 2^-10; in weight units, times the block's scale
REL, ABS = 2.0 ** -4, 2.0 ** -10


def rounding_bound(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Each weight's largest error under its block's scale."""
    n, k = weight.shape[-2:]
    per_weight = scale.repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]
    return REL * weight.abs() + ABS * per_weight


@pytest.mark.fast
@pytest.mark.parametrize("shape,block", [((3, 40, 72), 16), ((2, 48, 40), 128), ((5, 33), 8)])
def test_quantize_blocks_rounds_within_e4m3s_bound(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 0.05
    w.view(-1, *shape[-2:])[0, :block, :block] *= 40  # blocks of very different ranges: each needs its own scale
    q, scale = fp8.quantize_blocks(w, block)
    assert q.dtype == fp8.FP8 and q.shape == w.shape
    assert scale.shape == (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
    error = (fp8.dequantize_blocks(q, scale, block) - w).abs()
    assert (error <= rounding_bound(w, scale, block) * (1 + 1e-6)).all()
    assert error.max() > 0  # the values were rounded, not kept
    # each block's largest magnitude is FP8's largest: the whole range is used
    assert q.float().abs().amax() == fp8.FP8_MAX
    # a broken scale (the blocks' scales in reverse order: the first block's goes to the last) breaks the bound
    wrong = fp8.dequantize_blocks(q, reversed_blocks(scale), block)
    assert not ((wrong - w).abs() <= rounding_bound(w, scale, block)).all()


@pytest.mark.fast
def test_a_block_of_zeros_stays_zero():
    w = torch.zeros(4, 32)
    w[:, 16:] = torch.linspace(-1, 1, 64).reshape(4, 16)
    q, scale = fp8.quantize_blocks(w, 16)
    assert scale[0, 0] == 1 and (q[:, :16].float() == 0).all()
    assert torch.allclose(fp8.dequantize_blocks(q, scale, 16), w, rtol=REL, atol=0)


def quantized(module: torch.nn.Module, block: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module with fp8 experts, a copy holding the weights they stand for in fp32)."""
    module = copy.deepcopy(module)
    fp8.quantize_experts(module, block)
    truth = copy.deepcopy(module)
    for name in fp8.PROJECTIONS:
        setattr(truth, name, torch.nn.Parameter(fp8.dequantized(module, name, slice(None), torch.float32)))
    return module, truth


@pytest.mark.fast
@pytest.mark.parametrize("module_kind,tokens,top_k,experts,routing_kind", [
    ("thinker", 1, 3, 8, "random"),
    ("thinker", 17, 3, 8, "hot"),  # two blocks of pairs for expert 0
    ("talker", 5, 6, 8, "random"),
])
@pytest.mark.parametrize("tiles,block", [(moe.DECODE_TILES, 128), (SMALL_TILES, 16)], ids=["decode", "small"])
def test_fused_fp8_experts_match_the_eager_math_on_their_weights(module_kind, tokens, top_k, experts, routing_kind,
                                                                tiles, block):
    g, hidden, index, weights = inputs(routing_kind, tokens, top_k, experts, torch.float32, tokens * 7 + experts)
    module, truth = quantized(experts_module(module_kind, experts, top_k, torch.float32, g), block)
    ref = run(truth, "eager", hidden, index, weights)
    assert module.gate_up_proj.dtype == fp8.FP8
    with torch.inference_mode():
        out = moe.experts_forward(module, hidden, index, weights, tiles=tiles)
    assert torch.allclose(out, ref, atol=1e-5), float((out - ref).abs().max())
    assert ref.abs().max() > 0.1


@pytest.mark.fast
@pytest.mark.parametrize("shape,block", [((3, 40, 24), 16), ((200, 40), 128), ((2, 33, 17), 8)])
def test_widened_weights_are_the_eager_dequantisation(shape, block):
    """The widening kernel (its interpreter here) gives dequantize_blocks' values, edge blocks included: exactly in
    float32; in bf16 within one bf16 step of them (a device rounds to nearest, the interpreter truncates)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(block)) * 0.05
    q, scale = (t.to(DEVICE) for t in fp8.quantize_blocks(w, block))
    exact = fp8.dequantize_blocks(q, scale, block)
    out = fp8.widened(q, scale, block, torch.float32)
    assert out.shape == shape and torch.equal(out, exact)
    assert not torch.equal(out, fp8.dequantize_blocks(q, reversed_blocks(scale), block))
    narrow = fp8.widened(q, scale, block, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and ((narrow.float() - exact).abs() <= exact.abs() * 2.0 ** -7).all()


@pytest.mark.fast
def test_long_prefill_chunks_of_fp8_experts_take_grouped_mm_on_widened_weights(monkeypatch):
    """Past MAX_FUSED_PAIRS the fused kernels (decode tiles) step aside for grouped_mm on the weights widened for
    the call; the module keeps its FP8 weights."""
    tokens = moe.MAX_FUSED_PAIRS // 3 + 1
    g, hidden, index, weights = inputs("random", tokens, 3, 8, torch.float32, 7)
    module, truth = quantized(experts_module("thinker", 8, 3, torch.float32, g), 16)
    ref = run(truth, "eager", hidden, index, weights)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernels ran past MAX_FUSED_PAIRS")

    monkeypatch.setattr(moe, "fused_experts", refuse)
    with torch.inference_mode():
        out = moe.experts_forward(module, hidden, index, weights)
    assert torch.allclose(out, ref, atol=1e-4) and ref.abs().max() > 0.1
    assert module.gate_up_proj.dtype == module.down_proj.dtype == fp8.FP8


@pytest.mark.fast
def test_fp8_linear_widens_its_weight_for_many_rows(monkeypatch):
    """Up to WIDE_ROWS rows the FP8 kernel runs; past them F.linear on the widened weight, with the same values."""
    linear = fp8.Fp8Linear.quantized(torch.nn.Linear(40, 24).to(DEVICE), 16, fused=True)
    calls = []
    kernel = fp8.fp8_linear
    monkeypatch.setattr(fp8, "fp8_linear", lambda *args: calls.append(args[0].shape) or kernel(*args))
    g = torch.Generator().manual_seed(3)
    for rows in (fp8.WIDE_ROWS, fp8.WIDE_ROWS + 1):
        x = torch.randn(rows, 40, generator=g).to(DEVICE)
        ref = torch.nn.functional.linear(x, linear.dequantized_weight(torch.float32), linear.bias)
        with torch.inference_mode():
            assert torch.allclose(linear(x), ref, atol=1e-5)
    assert calls == [(fp8.WIDE_ROWS, 40)]


@pytest.mark.fast
def test_fused_fp8_tiles_stay_within_a_scale_block():
    """Through transformers' interface the reduction tile shrinks to the scale block (16 here, 128 by default);
    called directly with a tile across blocks, the kernels refuse."""
    g, hidden, index, weights = inputs("random", 3, 3, 8, torch.float32, 1)
    module, truth = quantized(experts_module("thinker", 8, 3, torch.float32, g), 16)
    ref = run(truth, "eager", hidden, index, weights)
    assert torch.allclose(run(module, moe.use_fused_experts(), hidden, index, weights), ref, atol=1e-5)
    scales = (module.gate_up_proj_scale_inv, module.down_proj_scale_inv, 16)
    with pytest.raises(ValueError, match="reduction tile"):
        moe.fused_experts(hidden, module.gate_up_proj, module.down_proj, index, weights, scales=scales)


@pytest.mark.fast
@pytest.mark.parametrize("routing_kind", ["random", "hot", "few"])
def test_dequantized_forward_matches_the_eager_math(routing_kind):
    g, hidden, index, weights = inputs(routing_kind, 9, 3, 8, torch.float32, 11)
    module, truth = quantized(experts_module("thinker", 8, 3, torch.float32, g), 16)
    ref = run(truth, "eager", hidden, index, weights)
    assert torch.allclose(run(module, fp8.use_dequantized_experts(), hidden, index, weights), ref, atol=1e-6)


class Fp8Copy:
    """A copy of the tiny model with its decoders in FP8 (blocks of 16: several per weight, eager dequantising
    experts), and the errors of its experts layers against the reference's on the reference's inputs."""

    def __init__(self, reference: torch.nn.Module, stack: str):
        self.hf = copy.deepcopy(reference)
        self.same = {id(m): q for m, q in zip(getattr(reference, stack).modules(), getattr(self.hf, stack).modules())}
        quantized = fp8_weights.quantize(self.hf, 16)[0]
        assert quantized == sum(c.text_config.num_hidden_layers for c in (self.hf.config.thinker_config,
                                                                            self.hf.config.talker_config))
        self.impl = fp8.use_dequantized_experts()
        for sub in (self.hf.thinker, self.hf.talker):
            sub.config.text_config._experts_implementation = self.impl
        self.stack = getattr(self.hf, stack)

    def layer_errors(self, calls: list[tuple]) -> list[float]:
        return [relative_rms(run(self.same[id(m)], self.impl, *args), out) for m, args, out in calls]

    def break_scales(self) -> None:
        """Each projection's block scales in reverse order: what the layers' bound must catch."""
        reverse_scales(self.stack)


@pytest.mark.fast
def test_tiny_thinker_stays_within_the_stated_bound(reference_model):
    """16 prompts of 24 random tokens teacher-forced through the tiny Thinker, fp32 against its decoders in FP8
    (blocks of 16: several per weight). The bound, from e4m3's rounding: a weight moves by at most 6.25 % of itself,
    2^-4 / sqrt(3) = 3.6 % RMS at most; two projections in series compound to ~5 %, so each MoE layer's output, on
    the same inputs, stays within `LAYER_BOUND` (8 %) relative RMS; the logits stay within 5 %, and the top-1 token
    is the same wherever the fp32 model's top-2 gap exceeds 4x the logits' RMS error (random weights leave many
    near-ties, which any rounding may flip). The tiny model's logits hardly depend on its experts, so the layers'
    bound is what a broken scale (each projection's block scales in reverse order) must fail, in every layer.
    Measured: 4.5 % in both layers (broken: 27-30 %); logits 3.6 %, 60 % of positions decisive, all agreeing."""
    vocab = reference_model.config.thinker_config.text_config.vocab_size
    prompts = torch.randint(0, vocab, (16, 24), generator=torch.Generator().manual_seed(0))
    ref, calls = teacher_forced(reference_model.thinker, lambda: reference_model.thinker(input_ids=prompts).logits)
    q = Fp8Copy(reference_model, "thinker")
    assert len(calls) == q.hf.thinker.config.text_config.num_hidden_layers
    out, _ = teacher_forced(q.stack, lambda: q.stack(input_ids=prompts).logits)
    assert max(q.layer_errors(calls)) <= LAYER_BOUND, q.layer_errors(calls)
    assert 0 < relative_rms(out, ref) <= 0.05
    decisive, same = agree_where_decisive(out, ref)
    assert decisive.float().mean() > 0.5 and same[decisive].all()
    q.break_scales()
    assert min(q.layer_errors(calls)) > LAYER_BOUND, q.layer_errors(calls)


@pytest.mark.fast
def test_tiny_talker_codec_frames_stay_within_the_stated_bound(reference_model):
    """Codec-frame agreement: 16 sequences of 24 random codec tokens teacher-forced through the tiny Talker, fp32
    against its decoder in FP8 (blocks of 16), the code predictor (not quantised) fed each model's own last hidden
    state and the fp32 model's greedy frame. The bound, stated before measuring, is the Thinker's: each MoE layer
    within `LAYER_BOUND`, the first code's logits and each residual group's within 5 % relative RMS, and the codes
    the same wherever the fp32 model's top-2 gap exceeds 4x that group's RMS error, here on at least 99 % of those
    (position, group) pairs: over 6,000 codes the errors' tails reach 6-10x their RMS. A broken scale fails the
    layers' bound. Measured: layers 4.5 and 4.6 % (broken: 35 and 25 %); first code 3.7 %, residual groups 0.5-2.1 %;
    88 % of codes decisive, 2 of them differing (gaps 4.2 and 4.4x); 77 % of whole frames equal (near-ties of random
    weights included)."""
    talker = reference_model.talker
    groups = talker.config.num_code_groups
    codes = torch.randint(0, talker.config.text_config.vocab_size, (16, 24), generator=torch.Generator().manual_seed(1))
    frames = greedy_frames(talker, codes, groups)
    (ref0, ref), calls = teacher_forced(talker, lambda: frame_logits(talker, codes, frames))
    q = Fp8Copy(reference_model, "talker")
    assert len(calls) == talker.config.text_config.num_hidden_layers
    with torch.inference_mode():
        out0, out = frame_logits(q.stack, codes, frames)
    assert max(q.layer_errors(calls)) <= LAYER_BOUND, q.layer_errors(calls)
    assert 0 < relative_rms(out0, ref0) <= 0.05
    assert max(relative_rms(out[..., j, :], ref[..., j, :]) for j in range(groups - 1)) <= 0.05
    pairs = [agree_where_decisive(out0, ref0), *(agree_where_decisive(out[..., j, :], ref[..., j, :])
                                                  for j in range(groups - 1))]
    decisive, same = (torch.stack(parts, -1) for parts in zip(*pairs, strict=True))
    assert decisive.float().mean() > 0.5 and same[decisive].float().mean() >= 0.99
    q.break_scales()
    assert min(q.layer_errors(calls)) > LAYER_BOUND, q.layer_errors(calls)


def dequantized_copy(hf: torch.nn.Module) -> torch.nn.Module:
    """A copy of a model with FP8 layers holding, in fp32, the weights those layers stand for."""
    hf = copy.deepcopy(hf)
    for name, module in list(hf.named_modules()):
        if isinstance(module, fp8.Fp8Linear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.dequantized_weight(torch.float32)
            if module.bias is not None:
                linear.bias.data = module.bias.data
            hf.set_submodule(name, linear)
        elif fp8.is_quantized(module):
            for proj in fp8.PROJECTIONS:
                weight = fp8.dequantized(module, proj, slice(None), torch.float32)
                delattr(module, proj)
                delattr(module, f"{proj}_scale_inv")
                setattr(module, proj, torch.nn.Parameter(weight))
    return hf


@pytest.fixture(scope="module")
def fp8_truth(reference_model):
    """The tiny model with the weights its FP8 layers stand for (blocks of 128, as the engine quantises), in fp32:
    the reference an FP8 engine must match."""
    hf = copy.deepcopy(reference_model)
    fp8_weights.quantize(hf, fp8.BLOCK)
    return dequantized_copy(hf)


@pytest.mark.parametrize("moe_backend", ["eager", pytest.param("triton", marks=cpu_only)])
async def test_fp8_engine_matches_generate_on_the_dequantised_weights(tiny_config, fp8_truth, moe_backend):
    cfg = dataclasses.replace(tiny_config, quantization="fp8", moe_backend=moe_backend)
    with started_engine(cfg) as eng:
        stacks = (eng.models.thinker.stack, eng.models.talker.stack)
        quantized_modules = [m for s in stacks for m in s.modules() if fp8.is_quantized(m)]
        assert len(quantized_modules) == sum(len(s.layers) for s in stacks)
        assert all(m.gate_up_proj.dtype == m.down_proj.dtype == fp8.FP8 for m in quantized_modules)
        linears = [m for s in stacks for m in s.modules() if isinstance(m, fp8.Fp8Linear)]
        assert len(linears) == 4 * len(stacks[0].layers) + 7 * len(stacks[1].layers)  # attention; + shared experts
        assert all(m.fused == (moe_backend == "triton") for m in linears)
        assert stacks[0].config._experts_implementation == (fp8.NAME if moe_backend == "eager" else moe.NAME)
        await assert_greedy_parity(eng, fp8_truth, f"fp8-{moe_backend}", "text")


@pytest.mark.fast
def test_quantization_auto_follows_the_device(reference_model, monkeypatch):
    """auto: FP8 where the weights take more than half the device, the engine's dtype otherwise; FP8 experts refuse
    an experts implementation that cannot read them."""
    import omnirt.pipeline.models.qwen3_omni.models as models
    from omnirt.pipeline.models.qwen3_omni.memory import device_bytes
    from omnirt.pipeline.platform import Platform

    weights = device_bytes(reference_model)  # parameters and buffers
    for total, want in ((int(weights * 1.9), "fp8"), (int(weights * 2.1), "none")):
        device = types.SimpleNamespace(mem_get_info=lambda total=total: (total, total))
        assert models._quantization("auto", weights, device) == want
    assert models._quantization("none", weights, device) == "none"
    gpu = Platform("cuda", "cpu", "nccl", True)
    with pytest.raises(ValueError, match="cannot read FP8 experts"):
        models._experts("grouped_mm", gpu, "fp8")
    monkeypatch.setattr(models, "available", lambda: False)
    assert models._experts("auto", gpu, "fp8") == fp8.NAME  # no Triton: dequantised


@pytest.mark.fast
def test_quantization_key():
    from omnirt.pipeline.config import EngineConfig, ProfileError

    assert EngineConfig(quantization="fp8").quantization == "fp8"
    assert EngineConfig(quantization="auto", moe_backend="grouped_mm").quantization == "auto"  # refused if FP8
    with pytest.raises(ProfileError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ProfileError, match="fp8 experts run on the fused Triton kernels"):
        EngineConfig(quantization="fp8", moe_backend="grouped_mm")


DECODER_LINEAR = re.compile(r"^(thinker|talker)\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
                            r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj)\.weight$")
CHECKPOINT_BLOCK = 16  # several blocks per weight at the tiny model's sizes


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory, reference_model) -> tuple[Path, torch.nn.Module]:
    """(the tiny checkpoint as FP8 checkpoints are published: the decoders' linear layers as float8_e4m3fn weights
    with a `weight_scale_inv` each, `quantization_config` in config.json; the tiny model with the weights those
    stand for, in fp32, set by the checkpoint's own keys)."""
    from safetensors.torch import load_file, save_file

    from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model

    path = tmp_path_factory.mktemp("tiny-fp8")
    shutil.copytree(ensure_tiny_model(), path, dirs_exist_ok=True)
    (file,) = path.glob("*.safetensors")
    tensors, truth = load_file(file), copy.deepcopy(reference_model)
    stacks = {"thinker": truth.thinker.model.language_model, "talker": truth.talker.model}
    for key in [k for k in tensors if DECODER_LINEAR.match(k)]:
        q, scale = fp8.quantize_blocks(tensors[key], CHECKPOINT_BLOCK)
        tensors[key], tensors[key.replace(".weight", ".weight_scale_inv")] = q, scale
        _set_weight(stacks, key, fp8.dequantize_blocks(q, scale, CHECKPOINT_BLOCK))
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [CHECKPOINT_BLOCK, CHECKPOINT_BLOCK]}
    (path / "config.json").write_text(json.dumps(config))
    return path, truth


def _set_weight(stacks: dict[str, torch.nn.Module], key: str, weight: torch.Tensor) -> None:
    """Set checkpoint weight `key` (per expert, as checkpoints store experts) in the loaded model's layout."""
    part, _, _, layer, *rest = key.split(".")
    module = stacks[part].layers[int(layer)]
    if rest[:2] != ["mlp", "experts"]:
        module.get_submodule(".".join(rest[:-1])).weight.data.copy_(weight)
        return
    experts, e, proj = module.mlp.experts, int(rest[2]), rest[3]
    inter = experts.gate_up_proj.shape[1] // 2
    rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, None), "down_proj": slice(None)}[proj]
    (experts.down_proj if proj == "down_proj" else experts.gate_up_proj).data[e, rows].copy_(weight)


@pytest.mark.fast
def test_an_fp8_checkpoint_loads_its_own_values_and_scales(fp8_checkpoint):
    """Every weight of the loaded model is the checkpoint's: FP8 experts (with the checkpoint's block size) stand
    for exactly the weights the checkpoint's values and scales do, the other quantised layers hold them, and the
    rest is untouched."""
    from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model

    path, truth = fp8_checkpoint
    hf, _, _ = load_hf_model(str(path), "auto", torch.float32, torch.device("cpu"))
    quantized_modules = [m for m in hf.modules() if fp8.is_quantized(m)]
    assert len(quantized_modules) == 4 and all(m.weight_block_size == (CHECKPOINT_BLOCK,) * 2
                                               for m in quantized_modules)  # 2 Thinker layers, 2 Talker layers
    assert sum(isinstance(m, fp8.Fp8Linear) for m in hf.modules()) == 4 * 2 + 7 * 2  # attention; + shared experts
    want = dict(truth.named_parameters())
    for name, param in dequantized_copy(hf).named_parameters():
        assert torch.equal(param, want[name]), name


async def test_an_fp8_checkpoint_serves_as_generate_on_its_weights(tiny_config, fp8_checkpoint):
    path, truth = fp8_checkpoint
    with started_engine(dataclasses.replace(tiny_config, model=str(path))) as eng:
        assert eng.models.thinker.stack.config._experts_implementation == fp8.NAME
        await assert_greedy_parity(eng, truth, "fp8-checkpoint", "text")



@pytest.mark.fast
def test_fused_fp8_kernels_compile_whole():
    """torch.compile takes the fused experts and the FP8 linear kernel with their scales as opaque ops (fullgraph:
    no break), as the engine's compiled decode layers do."""
    g, hidden, index, weights = inputs("random", 5, 3, 8, torch.float32, 13)
    module, truth = quantized(experts_module("thinker", 8, 3, torch.float32, g), 16)
    linear = fp8.Fp8Linear.quantized(torch.nn.Linear(40, 24).to(DEVICE), 16, fused=True)

    def layer(x, index, weights):
        return linear(moe.experts_forward(module, x, index, weights, tiles=SMALL_TILES))

    with torch.inference_mode():
        out = torch.compile(layer, fullgraph=True)(hidden, index, weights)
        ref = torch.nn.functional.linear(run(truth, "eager", hidden, index, weights),
                                         linear.dequantized_weight(torch.float32), linear.bias)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("rows,block,bias", [(1, 16, False), (37, 16, True), (5, 128, False)])
def test_fp8_linear_kernel_matches_the_dequantised_linear(rows, block, bias):
    """The Triton kernel (its interpreter here) and the widening path against F.linear on the weights the FP8 values
    stand for; leading dimensions kept."""
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(72, 40, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 72, generator=g) * 0.1)
    linear, x = linear.to(DEVICE), torch.randn(rows, 3, 72, generator=g).to(DEVICE)
    fused = fp8.Fp8Linear.quantized(linear, block, fused=True)
    widened = fp8.Fp8Linear.quantized(linear, block, fused=False)
    ref = torch.nn.functional.linear(x, fused.dequantized_weight(torch.float32), linear.bias)
    with torch.inference_mode():
        assert torch.allclose(fused(x), ref, atol=1e-5) and torch.equal(widened(x), ref)
    assert fused(x).shape == (rows, 3, 40) and fused.weight.dtype == fp8.FP8
    assert (fused.dequantized_weight(torch.float32) - linear.weight).abs().max() > 0  # rounded, not kept


@pytest.mark.fast
def test_the_full_size_accuracy_check_runs_on_the_tiny_model(tmp_path):
    """`python -m omnirt.loadtest.gpu.fp8_accuracy` (FP8 against the engine's dtype, teacher-forced; on the device at
    full size) on the tiny model: every MoE layer within the bound and every broken one outside it, the logits'
    errors and agreement reported, the JSON written (and drawn by `plot fp8-accuracy`), exit 0."""
    from omnirt.loadtest.gpu.fp8_accuracy import main

    out = tmp_path / "fp8-accuracy.json"
    assert main(["--model", "tiny", "--prompts", "4", "--tokens", "12", "--block", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [len(result["layers"][s]) for s in ("thinker", "talker")] == [2, 2] and result["fails"] == []
    assert max(max(e) for e in result["layers"].values()) <= LAYER_BOUND < min(min(e) for e in
                                                                                result["broken_layers"].values())
    assert 0 < result["thinker"]["relative_rms"][0] < 0.05 and len(result["talker"]["relative_rms"]) == 16
    from omnirt.loadtest.plot import fp8_accuracy

    fp8_accuracy(str(tmp_path / "fp8.png"), str(out))
    assert (tmp_path / "fp8.png").stat().st_size > 10_000


class _LiveExperts:
    """Decoder experts modules built while it is on, for counting those still in the engine's dtype."""

    def __init__(self, monkeypatch):
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

        self.built: weakref.WeakSet = weakref.WeakSet()
        for cls in (modeling.Qwen3OmniMoeThinkerTextExperts, modeling.Qwen3OmniMoeTalkerTextExperts):
            monkeypatch.setattr(cls, "__init__", self._registering(cls.__init__))

    def _registering(self, init):
        def registered(module, *args, **kwargs):
            init(module, *args, **kwargs)
            self.built.add(module)
        return registered

    def unquantised(self) -> int:
        """Those holding memory (not on the meta device) in the engine's dtype."""
        return sum(not fp8.is_quantized(m) and not m.gate_up_proj.is_meta for m in self.built)


@pytest.mark.fast
def test_dummy_weights_reach_the_device_in_fp8_a_layer_at_a_time(monkeypatch):
    """Dummy weights with an FP8 choice: each decoder layer is built, initialised and quantised before the next is
    built, so the device never holds more than one in the engine's dtype (the whole build, then quantising, holds
    all four of the tiny model); its weights are initialised as the whole build's are (finite, std 0.02, norms 1),
    the same on every start, and the choice is asked with the bytes of the whole build."""
    from omnirt.pipeline.models.qwen3_omni import weights
    from omnirt.pipeline.models.qwen3_omni.memory import device_bytes

    live, seen, asked = _LiveExperts(monkeypatch), [], []
    quantize_layer = fp8_weights.quantize_layer

    def counting(layer, block):
        seen.append(live.unquantised())
        return quantize_layer(layer, block)

    monkeypatch.setattr(fp8_weights, "quantize_layer", counting)
    monkeypatch.setattr(weights, "quantize_layer", counting)
    whole, *_ = weights.load_hf_model("tiny", "dummy", torch.float32, torch.device("cpu"))
    whole_bytes = weights.parts_bytes(whole, frozenset(weights.PARTS))
    fp8_weights.quantize(whole, 16)
    assert seen == [4, 3, 2, 1]  # the control: built whole, then quantised
    seen.clear()
    built = [weights.load_hf_model("tiny", "dummy", torch.float32, torch.device("cpu"),
                                   fp8=lambda n: asked.append(n) or 16)[0] for _ in range(2)]
    assert seen == [1] * 8 and asked == [whole_bytes] * 2
    assert [type(m).__name__ for m in built[0].modules() if fp8.is_quantized(m)] == [
        "Qwen3OmniMoeThinkerTextExperts"] * 2 + ["Qwen3OmniMoeTalkerTextExperts"] * 2
    assert device_bytes(built[0]) == device_bytes(whole) < whole_bytes  # as small as the whole build quantised
    tensors = [dict(b.state_dict()) for b in built]
    assert tensors[0].keys() == tensors[1].keys() == dict(whole.state_dict()).keys()
    for name, tensor in tensors[0].items():
        assert torch.equal(tensor, tensors[1][name]), name  # seeded: every start the same
        wide = tensor.float()
        assert torch.isfinite(wide).all(), name
    layer = built[0].thinker.model.language_model.layers[1]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    gate_up = fp8.dequantized(layer.mlp.experts, "gate_up_proj", slice(None), torch.float32)
    assert 0.018 < gate_up.std() < 0.022 and 0.018 < layer.self_attn.q_proj.dequantized_weight(torch.float32).std()


@pytest.mark.fast
def test_a_checkpoint_quantised_as_it_moves_equals_one_quantised_whole(monkeypatch, reference_model):
    """A bf16 (here fp32) checkpoint with an FP8 choice: each decoder layer moves to the device and is quantised
    before the next moves, and the result is exactly the whole model quantised after loading."""
    from omnirt.pipeline.models.qwen3_omni import weights

    events, moved = [], torch.nn.Module.to

    def to(module, *args, **kwargs):
        if type(module).__name__.endswith("DecoderLayer"):
            events.append("move")
        return moved(module, *args, **kwargs)

    quantize_layer = fp8_weights.quantize_layer
    monkeypatch.setattr(torch.nn.Module, "to", to)
    monkeypatch.setattr(fp8_weights, "quantize_layer", lambda layer, block: events.append("quantise")
                        or quantize_layer(layer, block))
    hf, *_ = weights.load_hf_model("tiny", "auto", torch.float32, torch.device("cpu"), fp8=lambda n: 16)
    assert events == ["move", "quantise"] * 4
    want = copy.deepcopy(reference_model)
    fp8_weights.quantize(want, 16)
    got, want = dict(hf.state_dict()), dict(want.state_dict())
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
