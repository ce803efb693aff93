"""GPU check of the MoE experts implementations at full size: eager vs captured, grouped_mm vs batched_mm.

One Thinker and one Talker sparse-MoE block (the released sizes, random bf16 weights) at decode batch
sizes 1/16/64. A captured graph is replayed on new inputs (new routing) and compared with an eager run
on the same inputs, so a graph that froze its routing or group sizes at capture shows up as a
mismatch, and one that hangs trips the watchdog (thread stacks to stderr, exit 3). Prints one JSON line
per (block, implementation, batch) with ms per call and the max abs diff of the graph replay.
"""

from __future__ import annotations

import faulthandler
import json
import sys

import torch
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from pipeline.models.qwen3_omni.released import ARCHITECTURE

BLOCKS = {
    "thinker": (cfgs.Qwen3OmniMoeTextConfig, mods.Qwen3OmniMoeThinkerTextSparseMoeBlock,
                ARCHITECTURE["thinker"]["text"]),
    "talker": (cfgs.Qwen3OmniMoeTalkerTextConfig, mods.Qwen3OmniMoeTalkerTextSparseMoeBlock,
               ARCHITECTURE["talker"]["text"]),
}


def build(name: str) -> torch.nn.Module:
    config_cls, block_cls, sizes = BLOCKS[name]
    config = config_cls(**sizes)
    torch.manual_seed(0)
    block = block_cls(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def timed(fn, n: int = 30) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def check(block: torch.nn.Module, impl: str, batch: int) -> dict:
    block.experts.config._experts_implementation = impl
    hidden = block.experts.config.hidden_size
    x = torch.randn(batch, 1, hidden, device="cuda", dtype=torch.bfloat16)
    eager_ms = timed(lambda: block(x))
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            block(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(static)
    fresh = torch.randn_like(x)
    static.copy_(fresh)
    faulthandler.dump_traceback_later(30, exit=True)  # a replay that never finishes
    graph.replay()
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    diff = (out.float() - block(fresh).float()).abs().max().item()
    graph_ms = timed(graph.replay)
    return {"block": block.__class__.__name__, "impl": impl, "batch": batch, "eager_ms": round(eager_ms, 3),
            "graph_ms": round(graph_ms, 3), "graph_max_abs_diff": diff}


def main() -> None:
    impls = sys.argv[1:] or ["batched_mm", "grouped_mm"]
    with torch.inference_mode():
        blocks = [build(name) for name in BLOCKS]
        for impl in impls:  # the implementation that may hang goes last
            for block in blocks:
                for batch in (1, 16, 64):
                    print(json.dumps(check(block, impl, batch)), flush=True)


if __name__ == "__main__":
    main()
