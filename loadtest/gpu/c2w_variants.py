"""Code2Wav formulations at full size on the device, timed against the eager module as served.

    python loadtest/gpu/c2w_variants.py [--shapes 16x50 64x50 1x50]

Variants of one released-size Code2Wav (random bf16 weights) through `Code2WavModel`'s decode step:
`eager` (as served today), `benchmark` (cuDNN benchmark mode picks each convolution's algorithm),
`compiled` (inductor over the whole step, one static shape per window size: the SnakeBeta
activations and the transformer's glue fused) and `compiled+graphs` (the compiled step captured).
Prints JSON lines: per variant and (batch, frames) the ms per decode call, the speed-up on eager, the
max abs difference from eager, and the compile seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from pipeline.models.qwen3_omni.code2wav import precompute_snake
from pipeline.models.qwen3_omni.released import ARCHITECTURE


def timed(fn, codes: torch.Tensor, n: int = 10) -> float:
    fn(codes)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(codes)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def graphed(fn, codes: torch.Tensor):
    """`fn(codes)` captured in a CUDA graph over a static copy of `codes`."""
    static = codes.clone()
    for _ in range(2):
        fn(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    return lambda c: (static.copy_(c), graph.replay(), out)[2]


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["16x50", "64x50", "1x50"], help="BATCHxFRAMES")
    args = p.parse_args()
    device = torch.device("cuda")
    module = mods.Qwen3OmniMoeCode2Wav(cfgs.Qwen3OmniMoeCode2WavConfig(**ARCHITECTURE["code2wav"]))
    module = module.to(device, torch.bfloat16).eval()
    precompute_snake(module)
    compiled = torch.compile(module, dynamic=False)
    for shape in args.shapes:
        b, f = map(int, shape.split("x"))
        for row in variants(module, compiled, torch.randint(0, 2048, (b, 16, f), device=device)):
            print(json.dumps({"batch": b, "frames": f, **row}), flush=True)


def variants(module, compiled, codes: torch.Tensor) -> list[dict]:
    """Each variant on one batch of windows: ms per call, speed-up on eager, max abs diff, compile seconds."""
    torch.backends.cudnn.benchmark = False
    ref = module(codes)
    runs = {"eager": module}
    torch.backends.cudnn.benchmark = True
    runs["benchmark"] = module
    t = time.perf_counter()
    compiled(codes)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t
    runs["compiled"] = compiled
    runs["compiled+graphs"] = graphed(compiled, codes)
    rows, base = [], None
    for name, fn in runs.items():
        torch.backends.cudnn.benchmark = name != "eager"
        ms = timed(fn, codes)
        base = base or ms
        rows.append({"variant": name, "ms": round(ms, 2), "speedup": round(base / ms, 2),
                     "max_abs_diff": round(float((fn(codes) - ref).abs().max()), 5),
                     "compile_s": round(compile_s, 1) if name == "compiled" else 0.0})
    return rows

if __name__ == "__main__":
    main()
