"""Code2Wav formulations timed against the eager module as served, and checked against eager float32.

    python -m omnirt.loadtest.gpu.c2w_variants [--shapes 1x50 16x50 64x50] [--variants eager gemm ...] [--tiny]

Variants of one Code2Wav (released size with random bf16 weights on the GPU; `--tiny`: the tiny model's
size in float32, on the CPU too, to check the script) through the engine's own rewrites
(`omnirt/pipeline/models/qwen3_omni/convolutions.py`, `Code2WavModel`'s compiled decoder): `eager` (as served
before), `benchmark` (cuDNN benchmark mode, which the engine leaves off; CUDA only), `channels_last`
(Conv1d as a height-1 Conv2d in NHWC; also with benchmark mode), `gemm` (convolutions as matmuls over their
taps, the transposed ones as a matmul and an overlap-add, time-major), `triton` (the convolutions as Triton
kernels with SnakeBeta and the residual in their epilogues, time-major: `qwen3_omni/snake_conv.py`), `compiled`
(inductor over the whole decoder, dynamic shapes as the engine compiles it), `compiled-autotune` (mode
max-autotune-no-cudagraphs), their combinations, and `+graphs` (the step captured in a CUDA graph at each
shape, as the engine captures its batch buckets).
Prints JSON lines per variant and BATCHxFRAMES (windows of FRAMES frames, `--context` of them left
context): ms per decode call, ms per new frame, the speed-up on eager, the max abs difference and the SNR
against eager float32, and the seconds of the first call (compilation, autotuning).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from omnirt.pipeline.models.qwen3_omni.code2wav import compiled_decoder
from omnirt.pipeline.models.qwen3_omni.convolutions import use_conv_backend
from omnirt.pipeline.models.qwen3_omni.released import ARCHITECTURE

# name -> (conv_backend, compile mode or None, captured in a graph)
VARIANTS = {
    "eager": ("native", None, False),
    "benchmark": ("native", None, False),
    "channels_last": ("channels_last", None, False),
    "channels_last+benchmark": ("channels_last", None, False),
    "gemm": ("gemm", None, False),
    "triton": ("triton", None, False),
    "triton+graphs": ("triton", None, True),
    "compiled+triton": ("triton", "default", False),
    "compiled": ("native", "default", False),
    "compiled-autotune": ("native", "max-autotune-no-cudagraphs", False),
    "compiled+channels_last": ("channels_last", "default", False),
    "compiled+gemm": ("gemm", "default", False),
    "compiled-autotune+gemm": ("gemm", "max-autotune-no-cudagraphs", False),
    "compiled+graphs": ("native", "default", True),
    "compiled+gemm+graphs": ("gemm", "default", True),
    "compiled+channels_last+graphs": ("channels_last", "default", True),
}


def base_module(tiny: bool, device: torch.device) -> torch.nn.Module:
    """Code2Wav in float32 with random weights: the released architecture, or the tiny model's."""
    if tiny:
        from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model

        return load_hf_model("tiny", "auto", torch.float32, torch.device("cpu"))[0].code2wav.to(device).eval()
    torch.manual_seed(0)
    with device:
        module = mods.Qwen3OmniMoeCode2Wav(cfgs.Qwen3OmniMoeCode2WavConfig(**ARCHITECTURE["code2wav"]))
    return module.eval()


def variant(base: torch.nn.Module, name: str, dtype: torch.dtype):
    """The decode function of variant `name` (before capture) over a copy of `base` in `dtype`."""
    backend, mode, _ = VARIANTS[name]
    module = copy.deepcopy(base).to(dtype)
    use_conv_backend(module, backend)
    if mode == "default":
        return compiled_decoder(module)
    if mode is not None:
        return torch.compile(module, dynamic=True, mode=mode)
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, codes: torch.Tensor, n: int) -> float:
    sync(codes.device)
    started = time.perf_counter()
    for _ in range(n):
        fn(codes)
    sync(codes.device)
    return 1e3 * (time.perf_counter() - started) / n


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


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float | None:
    """None: identical."""
    noise = float(((out.float() - ref) ** 2).sum())
    return None if noise == 0 else round(10 * math.log10(float((ref**2).sum()) / noise), 1)


def measure(fns: dict, shape: str, base: torch.nn.Module, args, device: torch.device) -> list[dict]:
    batch, frames = map(int, shape.split("x"))
    g = torch.Generator().manual_seed(batch * 1000 + frames)
    codes = torch.randint(0, base.config.codebook_size, (batch, 16, frames), generator=g).to(device)
    ref = base(codes)  # eager float32
    rows, base_ms = [], None
    for name, fn in fns.items():
        torch.backends.cudnn.benchmark = "benchmark" in name  # the engine leaves it off
        started = time.perf_counter()
        out = fn(codes)
        sync(device)
        first_s = time.perf_counter() - started
        if VARIANTS[name][2]:
            fn = graphed(fn, codes)
            out = fn(codes)
        ms = timed_ms(fn, codes, args.iters)
        base_ms = base_ms or ms
        diff = float((out.float() - ref).abs().max())
        rows.append({"variant": name, "batch": batch, "frames": frames, "ms": round(ms, 2),
                     "ms_per_frame": round(ms / (batch * (frames - args.context)), 4),
                     "speedup": round(base_ms / ms, 2), "max_abs_diff": round(diff, 5),
                     "snr_db": snr_db(ref, out), "first_call_s": round(first_s, 1)})
    return rows


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1x50", "16x50", "64x50"], help="BATCHxFRAMES")
    p.add_argument("--context", type=int, default=25, help="left-context frames of each window (not new audio)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="the tiny model's size in float32 (runs on the CPU)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", nargs="*", default=[], choices=list(VARIANTS),
                   help="also write these variants' kernels at the first shape, by device time, to "
                   "$OUT/c2w-profile-VARIANT.txt")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    names = [n for n in args.variants if device.type == "cuda" or not ("benchmark" in n or VARIANTS[n][2])]
    base = base_module(args.tiny, device)
    fns = {n: variant(base, n, dtype) for n in ["eager"] + [n for n in names if n != "eager"]}
    for shape in args.shapes:
        for row in measure(fns, shape, base, args, device):
            print(json.dumps(row), flush=True)
    for name in args.profile:
        profile(fns[name], name, args.shapes[0], base, device)


def profile(fn, name: str, shape: str, base: torch.nn.Module, device: torch.device) -> None:
    """Kernels of a few calls of `fn` at `shape`, by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch, frames = map(int, shape.split("x"))
    codes = torch.randint(0, base.config.codebook_size, (batch, 16, frames), device=device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn(codes)
        sync(device)
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"c2w-profile-{name}.txt")
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=80))


if __name__ == "__main__":
    main()
