"""FP8 against the engine's dtype on the same weights, teacher-forced: the Thinker's logits on random prompts, the
Talker's codec frames on random codes, and each MoE layer's output on the reference's own inputs.

    python3 -m omnirt.loadtest.gpu.fp8_accuracy --out fp8-accuracy.json       # the released architecture, dummy
    python3 -m omnirt.loadtest.gpu.fp8_accuracy --model tiny --prompts 2      # the tiny model, on the CPU

The model loads whole in the engine's dtype (bf16 on a GPU: 65.7 GiB, which an 80 GB card holds without KV caches),
the references are taken, then the decoders are quantised in place as the engine quantises them and run through the
engine's kernels (the fused Triton experts where they run). The bound is stated before measuring, as for the tiny
model in `tests/test_fp8.py`: each MoE layer's output within `LAYER_BOUND` relative RMS, and the top-1 token (code)
the same on at least `AGREE` of the positions whose reference top-2 gap exceeds 4x the logits' RMS error. The
logits' error itself is reported, not bounded: it compounds over the layers. The negative control, each projection's
block scales in reverse order, must fail the layers' bound in every layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from omnirt.pipeline.kernels import fp8

LAYER_BOUND = 0.08  # an MoE layer's relative RMS error in FP8: two projections of e4m3 rounding (3.6 % RMS each)
AGREE = 0.99  # the share of decisive positions whose top-1 must agree
DECODE_ROWS = 16  # rows of a decode step: the fused FP8 kernels (a prompt's thousand rows take widened weights)


def teacher_forced(stack: torch.nn.Module, forward) -> tuple:
    """(`forward()`'s result, each experts module of `stack` with its inputs and output), teacher-forced."""
    calls = []
    hooks = [m.register_forward_hook(lambda m, args, out: calls.append((m, args, out)))
             for m in stack.modules() if all(hasattr(m, p) for p in fp8.PROJECTIONS)]
    try:
        with torch.inference_mode():
            return forward(), calls
    finally:
        for hook in hooks:
            hook.remove()


def relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).square().mean().sqrt() / ref.square().mean().sqrt())


def agree_where_decisive(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions whose reference top-2 gap exceeds 4x the logits' RMS error, whether out's top-1 is ref's)."""
    top2 = ref.topk(2, dim=-1).values
    decisive = top2[..., 0] - top2[..., 1] > 4 * (out - ref).square().mean().sqrt()
    return decisive, out.argmax(-1) == ref.argmax(-1)


def frame_logits(talker: torch.nn.Module, codes: torch.Tensor, frames: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of every code of each position's frame, teacher-forced: the Talker on the embeddings of `codes`
    (B, T) gives each position's first code; its code predictor, on that position's last hidden state and the
    first G-1 codes of `frames` (B, T, G), the other G-1, as transformers' generate() feeds them.
    Returns ((B, T, V0), (B, T, G-1, V)), in float32."""
    b, t = codes.shape
    position_ids = torch.arange(t, device=codes.device).expand(3, b, t)
    out = talker(inputs_embeds=talker.get_input_embeddings()(codes), position_ids=position_ids,
                 output_hidden_states=True)
    predictor, flat = talker.code_predictor, frames.reshape(b * t, -1)
    embeds = [talker.get_input_embeddings()(flat[:, :1]),
              *(table(flat[:, i + 1:i + 2]) for i, table in enumerate(predictor.get_input_embeddings()[:-1]))]
    states = predictor.model(inputs_embeds=torch.cat([out.hidden_states[0][-1].reshape(b * t, 1, -1), *embeds], 1))
    rest = torch.stack([head(states.last_hidden_state[:, j + 1]) for j, head in enumerate(predictor.lm_head)], 1)
    return out.logits.float(), rest.reshape(b, t, *rest.shape[1:]).float()


def greedy_frames(talker: torch.nn.Module, codes: torch.Tensor, groups: int) -> torch.Tensor:
    """The frame each position of `codes` decodes to greedily, one code group after another."""
    frames = torch.zeros(*codes.shape, groups, dtype=torch.long, device=codes.device)
    with torch.inference_mode():
        frames[..., 0] = frame_logits(talker, codes, frames)[0].argmax(-1)
        for j in range(1, groups):
            frames[..., j] = frame_logits(talker, codes, frames)[1][..., j - 1].argmax(-1)
    return frames


def layer_errors(calls: list[tuple], impl: str, rows: int | None = None) -> list[float]:
    """Each recorded experts module, now FP8, on its recorded inputs against its recorded output; `rows`: on the
    first rows only, a decode step's batch (the fused kernels; a whole prompt takes the widened weights)."""
    errors = []
    for module, args, out in calls:
        module.config._experts_implementation = impl
        with torch.inference_mode():
            errors.append(round(relative_rms(module(*(a[:rows] for a in args)), out[:rows]), 5))
    return errors


def reversed_blocks(scale: torch.Tensor) -> torch.Tensor:
    return scale.flatten().flip(0).reshape(scale.shape)


def reverse_scales(hf: torch.nn.Module) -> None:
    """Each FP8 projection's block scales in reverse order: what the layers' bound must catch."""
    for experts in (m for m in hf.modules() if fp8.is_quantized(m)):
        for name in fp8.PROJECTIONS:
            scale = getattr(experts, f"{name}_scale_inv")
            scale.copy_(reversed_blocks(scale))


def agreement(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    """Relative RMS of each logits tensor, and top-1 agreement over all and over the decisive positions."""
    pairs = [agree_where_decisive(o, r) for o, r in zip(outs, refs, strict=True)]
    decisive = torch.cat([d.flatten() for d, _ in pairs])
    same = torch.cat([s.flatten() for _, s in pairs])
    return {"relative_rms": [round(relative_rms(o, r), 5) for o, r in zip(outs, refs, strict=True)],
            "top1_agree": round(float(same.float().mean()), 4), "decisive": round(float(decisive.float().mean()), 4),
            "agree_where_decisive": round(float(same[decisive].float().mean()), 4) if decisive.any() else None}


def measure(hf, args: argparse.Namespace, device: torch.device) -> dict:
    """The references, then the decoders quantised in place, then the comparisons and the negative control."""
    from omnirt.pipeline.kernels.moe import use_fused_experts
    from omnirt.pipeline.kernels.triton_runtime import available
    from omnirt.pipeline.models.qwen3_omni import fp8_weights

    g = torch.Generator().manual_seed(0)
    thinker, talker = hf.thinker, hf.talker
    prompts = torch.randint(0, thinker.config.text_config.vocab_size, (args.prompts, args.tokens), generator=g)
    codes = torch.randint(0, talker.config.text_config.vocab_size, (args.prompts, args.tokens), generator=g)
    prompts, codes = prompts.to(device), codes.to(device)
    frames = greedy_frames(talker, codes, talker.config.num_code_groups)
    ref_text, text_calls = teacher_forced(thinker, lambda: thinker(input_ids=prompts).logits.float())
    ref_codes, code_calls = teacher_forced(talker, lambda: frame_logits(talker, codes, frames))
    fused = device.type == "cuda" and available()
    fp8_weights.quantize(hf, args.block)
    fp8_weights.set_fused(hf, fused)
    impl = use_fused_experts() if fused else fp8.use_dequantized_experts()
    for sub in (thinker, talker):
        sub.config.text_config._experts_implementation = impl
    with torch.inference_mode():
        out_text = thinker(input_ids=prompts).logits.float()
        out_codes = frame_logits(talker, codes, frames)
    calls = {"thinker": text_calls, "talker": code_calls}
    layers = {stack: layer_errors(c, impl) for stack, c in calls.items()}
    step = {stack: layer_errors(c, impl, DECODE_ROWS) for stack, c in calls.items()}
    reverse_scales(hf)
    broken = {stack: layer_errors(c, impl) for stack, c in calls.items()}
    groups = [out_codes[1][..., j, :] for j in range(out_codes[1].shape[-2])]
    ref_groups = [ref_codes[1][..., j, :] for j in range(ref_codes[1].shape[-2])]
    return {"experts": impl, "layers": layers, "decode_layers": step, "broken_layers": broken,
            "thinker": agreement([out_text], [ref_text]),
            "talker": agreement([out_codes[0], *groups], [ref_codes[0], *ref_groups])}


def verdict(result: dict) -> list[str]:
    """What fails the bound stated in advance (empty: it holds)."""
    why = [f"{stack} {kind} {i}: {e:.3f} > {LAYER_BOUND}" for kind in ("layers", "decode_layers")
           for stack, errors in result[kind].items() for i, e in enumerate(errors) if e > LAYER_BOUND]
    why += [f"{stack} broken layer {i}: {e:.3f} within the bound" for stack, errors in result["broken_layers"].items()
            for i, e in enumerate(errors) if e <= LAYER_BOUND]
    for stack in ("thinker", "talker"):
        agree = result[stack]["agree_where_decisive"]
        if agree is not None and agree < AGREE:
            why.append(f"{stack}: top-1 agrees on {agree:.2%} of decisive positions < {AGREE:.0%}")
    return why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-omni-30b-a3b", help="tiny, or the released architecture (dummy weights)")
    p.add_argument("--prompts", type=int, default=16, help="prompts (and codec sequences)")
    p.add_argument("--tokens", type=int, default=64, help="tokens a prompt")
    p.add_argument("--block", type=int, default=fp8.BLOCK, help="the FP8 scale block")
    p.add_argument("--out", type=Path, help="the result as JSON")
    args = p.parse_args(argv)
    from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe = "grouped_mm" if device.type == "cuda" else "eager"
    hf = load_hf_model(args.model, "dummy", dtype, device, moe)[0]
    result = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts,
              "tokens": args.tokens, "block": args.block, **measure(hf, args, device)}
    result["fails"] = verdict(result)
    print(summary(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if result["fails"] else 0


def summary(result: dict) -> str:
    """The result in a few lines: each stack's layers (worst, and the broken control's best), logits, agreement."""
    lines = [f"{result['model']} ({result['dtype']} against FP8, blocks of {result['block']}, experts "
             f"{result['experts']}): {result['prompts']} x {result['tokens']} tokens teacher-forced"]
    for stack in ("thinker", "talker"):
        layers, broken, logits = result["layers"][stack], result["broken_layers"][stack], result[stack]
        step = result["decode_layers"][stack]
        lines.append(f"{stack}: {len(layers)} MoE layers, relative RMS mean {sum(layers) / len(layers):.4f} max "
                     f"{max(layers):.4f}, on {DECODE_ROWS} rows max {max(step):.4f} (bound {LAYER_BOUND}; reversed "
                     f"scales: min {min(broken):.4f}); logits "
                     f"{', '.join(f'{e:.4f}' for e in logits['relative_rms'][:4])}"
                     f"{' ...' if len(logits['relative_rms']) > 4 else ''}; top-1 agrees on {logits['top1_agree']:.2%}"
                     f", on {logits['agree_where_decisive']:.2%} of the decisive ({logits['decisive']:.0%} of all)")
    lines.append("fails: " + ("; ".join(result["fails"]) or "none"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
