"""Code2Wav at full size: FLOPs per chunk, and on a GPU its captured (batch, frames) graphs against eager.

    python -m omnirt.loadtest.gpu.c2w_check [--max-batch 16]   (the GPU driver's `c2w-check` scenario)

Builds the released Code2Wav (random weights) through `Code2WavModel`, the engine's own wrapper, so the
buckets are the ones the 1-GPU profile derives (4-frame first chunk, 25-frame chunks, 25 frames of left
context). Prints JSON lines: the FLOPs of one steady chunk (25 new + 25 context frames), the memory the
graphs take, and per (batch, frames) the graph-vs-eager max abs diff and ms per decode call.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from omnirt.pipeline.models.qwen3_omni.code2wav import Code2WavModel, CodecWindow, frame_buckets
from omnirt.pipeline.models.qwen3_omni.released import ARCHITECTURE
from omnirt.pipeline.platform import detect_platform


def windows(batch: int, frames: int, context: int) -> list[CodecWindow]:
    g = torch.Generator().manual_seed(batch * 1000 + frames)
    return [CodecWindow(torch.randint(0, 2048, (frames, 16), generator=g).tolist(), context, context == 0)
            for _ in range(batch)]


def timed(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - t) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args()
    platform = detect_platform()
    device = platform.device(0)
    dtype = torch.bfloat16 if platform.supports_graphs else torch.float32
    module = mods.Qwen3OmniMoeCode2Wav(cfgs.Qwen3OmniMoeCode2WavConfig(**ARCHITECTURE["code2wav"]))
    module = module.to(device, dtype).eval()
    c2w = Code2WavModel(module, device, platform, enforce_eager=False, max_batch=args.max_batch,
                        frame_sizes=frame_buckets(4, 25, 25))
    with FlopCounterMode(display=False) as flops, torch.inference_mode():
        c2w.decode(windows(1, 50, 25))
    print(json.dumps({"chunk": "25 new + 25 context frames, batch 1", "gflop": round(flops.get_total_flops() / 1e9, 1),
                      "params_m": round(sum(p.numel() for p in module.parameters()) / 1e6, 1)}), flush=True)
    if not platform.supports_graphs:
        return
    before = torch.cuda.memory_reserved(device)
    t = time.perf_counter()
    c2w.capture_cuda_graphs()
    print(json.dumps({"graphs": len(c2w.cuda_graphs), "capture_s": round(time.perf_counter() - t, 1),
                      "graph_memory_gib": round((torch.cuda.memory_reserved(device) - before) / 2**30, 2)}), flush=True)
    for batch, frames, context in [(1, 4, 0), (1, 50, 25), (4, 33, 25), (8, 50, 25), (16, 50, 25)]:
        ws = windows(batch, frames, context)
        c2w.cuda_graphs.enabled = True
        graphed = c2w.decode(ws)
        graph_ms = timed(lambda ws=ws: c2w.decode(ws))
        c2w.cuda_graphs.enabled = False
        eager = c2w.decode(ws)
        eager_ms = timed(lambda ws=ws: c2w.decode(ws))
        diff = max(float(abs(a - b).max()) for a, b in zip(graphed, eager))
        print(json.dumps({"batch": batch, "frames": frames, "max_abs_diff": diff, "graph_ms": round(graph_ms, 2),
                          "eager_ms": round(eager_ms, 2)}), flush=True)


if __name__ == "__main__":
    main()
