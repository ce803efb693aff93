"""GPU check of the MoE experts implementations at full size: eager, batched_mm, grouped_mm and the fused
Triton kernels (`omnirt/pipeline/kernels/moe.py`) at a few tile sizes.

One Thinker and one Talker sparse-MoE block (the released sizes, random bf16 weights) at decode batch sizes
1/16/64. A captured graph is replayed on new inputs (new routing) and compared with an eager run of the same
implementation on those inputs, so a graph that froze its routing or group sizes at capture shows up as a
mismatch, and one that hangs trips the watchdog (thread stacks to stderr, exit 3). Each output is also compared
with the block in fp32 on the same bf16 weights and the same routing (the bf16 router's choice: an fp32 router
would break near-ties otherwise) through transformers' eager experts loop: max abs diff and
||out - ref|| / ||ref||. The `eager` row is that loop in bf16, for scale (it reads the routing on the host, so
it has no graph). GB/s: the bytes of the experts the new routing hits (distinct experts x bytes per expert) over
the replay time; the block also reads its router (and the Talker's shared expert), so this is a lower bound on
what the replay moves.

Prints one JSON line per (block, implementation, batch), then a markdown table of ms per block call in the
graph (eager for `eager`), the fastest per row in bold.

    python3 -m omnirt.loadtest.gpu.moe_check [IMPL ...]   # default: every implementation below
"""

from __future__ import annotations

import copy
import faulthandler
import functools
import json
import sys
import time

import torch
from transformers.integrations.moe import ExpertsInterface
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfgs
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as mods

from omnirt.pipeline.kernels import moe
from omnirt.pipeline.models.qwen3_omni.released import ARCHITECTURE

BLOCKS = {
    "thinker": (cfgs.Qwen3OmniMoeTextConfig, mods.Qwen3OmniMoeThinkerTextSparseMoeBlock,
                ARCHITECTURE["thinker"]["text"]),
    "talker": (cfgs.Qwen3OmniMoeTalkerTextConfig, mods.Qwen3OmniMoeTalkerTextSparseMoeBlock,
               ARCHITECTURE["talker"]["text"]),
}
BATCHES = (1, 16, 64)
# the registered default first; more column tiles (more programs at batch 1); shorter reductions
TILES = (moe.DECODE_TILES, moe.Tiles(16, 32, 128, 4, 4), moe.Tiles(16, 128, 64, 4, 3))


def tiles_name(t: moe.Tiles) -> str:
    return moe.NAME if t == moe.DECODE_TILES else f"{moe.NAME}:{t.block_m}x{t.block_n}x{t.block_k}:w{t.num_warps}" \
                                                  f":s{t.num_stages}"


def register_tiles() -> list[str]:
    """One experts implementation per tile configuration; returns their names."""
    moe.use_fused_experts()
    for t in TILES[1:]:
        ExpertsInterface.register(tiles_name(t), functools.partial(moe.experts_forward, tiles=t))
    return [tiles_name(t) for t in TILES]


class SameRouting(torch.nn.Module):
    """The bf16 block's router inside the fp32 reference block, so that both pick the same experts."""

    def __init__(self, gate: torch.nn.Module):
        super().__init__()
        self.gate = gate

    def forward(self, hidden: torch.Tensor):
        return tuple(t if t.dtype == torch.long else t.float() for t in self.gate(hidden.to(torch.bfloat16)))


def reference(block: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(block).float()
    ref.gate = SameRouting(block.gate)
    return ref


def build(name: str) -> torch.nn.Module:
    config_cls, block_cls, sizes = BLOCKS[name]
    config = config_cls(**sizes)
    torch.manual_seed(0)
    block = block_cls(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def timed(fn, n: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def run(block: torch.nn.Module, impl: str, x: torch.Tensor) -> torch.Tensor:
    block.experts.config._experts_implementation = impl
    return block(x)


def replayed(block: torch.nn.Module, impl: str, x: torch.Tensor, fresh: torch.Tensor):
    """(output of a graph captured on `x` and replayed on `fresh`, the graph)."""
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(block, impl, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(block, impl, static)
    static.copy_(fresh)
    faulthandler.dump_traceback_later(30, exit=True)  # a replay that never finishes
    graph.replay()
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    return out, graph


def check(name: str, block: torch.nn.Module, ref_block: torch.nn.Module, impl: str, batch: int) -> dict:
    g = torch.Generator("cuda").manual_seed(batch)  # every implementation sees the same inputs
    hidden = block.experts.config.hidden_size
    x, fresh = (torch.randn(batch, 1, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    row = {"block": name, "impl": impl, "batch": batch, "eager_ms": round(timed(lambda: run(block, impl, x)), 4)}
    if impl == "eager":  # its loop reads the routing on the host
        out = run(block, impl, fresh)
    else:
        out, graph = replayed(block, impl, x, fresh)
        row["graph_ms"] = round(timed(graph.replay), 4)
        row["graph_max_abs_diff"] = (out.float() - run(block, impl, fresh).float()).abs().max().item()
    ref = run(ref_block, "eager", fresh.float()).float()
    hit = block.gate(fresh.view(batch, hidden))[2].unique().numel()
    expert_bytes = hit * (block.experts.gate_up_proj[0].nbytes + block.experts.down_proj[0].nbytes)
    row.update(max_abs_diff=(out.float() - ref).abs().max().item(),
               rel_diff=((out.float() - ref).norm() / ref.norm()).item(), experts_hit=hit,
               expert_mb=round(expert_bytes / 2**20, 1),
               expert_gbps=round(expert_bytes / (row.get("graph_ms", row["eager_ms"]) * 1e-3) / 1e9, 1))
    return row


def table(rows: list[dict], impls: list[str]) -> str:
    """Rows (block, batch), a column per implementation: ms per block call (expert GB/s)."""
    lines = ["| block | batch | experts hit | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    for name in BLOCKS:
        for batch in BATCHES:
            got = {r["impl"]: r for r in rows if (r["block"], r["batch"]) == (name, batch) and "error" not in r}
            if not got:
                continue
            ms = {i: r.get("graph_ms", r["eager_ms"]) for i, r in got.items()}
            best = min(ms, key=ms.get)
            cells = [("**{:.3f}**" if i == best else "{:.3f}").format(ms[i]) + f" ({got[i]['expert_gbps']:.0f})"
                     if i in got else "—" for i in impls]
            hit = next(iter(got.values()))["experts_hit"]
            lines.append(f"| {name} | {batch} | {hit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    started = time.time()
    fused = register_tiles()
    impls = sys.argv[1:] or ["eager", "batched_mm", "grouped_mm", *fused]  # the newest kernels last
    rows = []
    with torch.inference_mode():
        blocks = {name: build(name) for name in BLOCKS}
        refs = {name: reference(block) for name, block in blocks.items()}
        for impl in impls:
            for name, block in blocks.items():
                for batch in BATCHES:
                    try:
                        row = check(name, block, refs[name], impl, batch)
                    except Exception as exc:  # e.g. a tile configuration that does not fit: report, go on
                        row = {"block": name, "impl": impl, "batch": batch, "error": repr(exc)[:300]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nms per block call in a CUDA graph (eager for `eager`), in brackets GB/s over the hit experts' "
          f"weights; {time.time() - started:.0f} s in all\n")
    print(table(rows, impls))


if __name__ == "__main__":
    main()
