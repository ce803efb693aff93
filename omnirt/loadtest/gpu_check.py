"""GPU check mode: does the fast path give what the plain path gives, on the device?

Runs the same greedy requests twice through one engine (the same weights, the same KV cache): first
as served (CUDA graphs, attention reading the slot cache in place where the profile has it), then
eagerly with transformers' SDPA over a dense copy of the cache (the path the CPU parity suite checks
against generate()). Compares text tokens and audio; prints a JSON summary. Where the two runs part
(bf16 rounding differs between the paths, and random weights give near-ties), the summary shows the
top-2 logit gap of both runs at that step next to the logit noise between the paths before it: a
divergence whose gap is within that noise is a tie, not a bug. Full size:
`python omnirt/loadtest/gpu_check.py --num-requests 8 --thinker-tokens 32 --frames 16 -- --model
qwen3-omni-30b-a3b --load-format dummy --deploy-config qwen3_omni_moe_1gpu`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import torch

from omnirt.pipeline.api import OmniRequest, collect_reply


async def run_all(engine, prompts: list[str], tag: str, thinker_tokens: int, frames: int):
    async def one(i: int, text: str):
        req = OmniRequest(f"{tag}-{i}", [{"role": "user", "content": text}], ("text", "audio"),
                          thinker_sampling={"temperature": 0.0, "max_tokens": thinker_tokens,
                                            "min_tokens": thinker_tokens},
                          talker_sampling={"temperature": 0.0, "max_tokens": frames + 1, "min_tokens": frames + 1})
        reply = await collect_reply(await engine.submit(req))
        return reply.token_ids, np.frombuffer(reply.pcm16, "<i2").astype(np.float32) / 32768

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return out, time.perf_counter() - t0


def record_top2(engine) -> dict[str, dict[tuple[str, int], tuple[list[float], int]]]:
    """Per stage, (request id, step) -> the top-2 logits and the token sampled, for every sampled row."""
    book: dict[str, dict] = {}
    for stage in engine.stages:
        runner, rows = stage.runner, book.setdefault(stage.name, {})

        def run(batch, original=runner.run, rows=rows):
            outs = original(batch)
            sampled = [(r.request_id, len(r.output_ids), o) for r, o in zip(batch.requests, outs)
                       if getattr(o, "logits", None) is not None]
            if sampled:
                values = torch.topk(torch.stack([o.logits for *_, o in sampled]).float(), 2).values
                for (rid, step, o), v in zip(sampled, values.tolist()):
                    rows[(rid, step)] = (v, o.token)
            return outs

        runner.run = run
    return book


def divergence(rows: dict, i: int) -> dict | None:
    """Where request i's served and plain runs first chose different tokens, with the top-2 gap of each
    there and the largest difference of the chosen token's logit over the steps before."""
    noise, step = 0.0, 0
    while (a := rows.get((f"graph-{i}", step))) and (b := rows.get((f"eager-{i}", step))):
        if a[1] != b[1]:
            return {"step": step, "gap_served": round(a[0][0] - a[0][1], 4), "gap_plain": round(b[0][0] - b[0][1], 4),
                    "noise_before": round(noise, 4)}
        noise = max(noise, abs(a[0][0] - b[0][0]))
        step += 1
    return None


def plain_path(engine) -> None:
    """Graphs off (prefill's too), steps as written (not compiled), and attention over a dense copy of the cache
    (SDPA)."""
    m = engine.models
    m.thinker.prefill.cuda_graphs.enabled = m.talker.prefill.cuda_graphs.enabled = False
    for kv in (m.thinker.kv, m.talker.kv, m.talker.predictor_kv):
        kv.in_place = False
    m.thinker.decode_layers = m.talker.decode_layers = m.talker.predictor_layers = None
    for cache, kv in ((m.thinker.cuda_graphs, m.thinker.kv), (m.talker.decode_graphs, m.talker.kv),
                      (m.talker.predictor_graphs, None)):
        cache.enabled = False
        if kv is not None:  # the decode steps are told the length of their dense copy
            cache.lengths = kv.graph_lengths()


async def main_async(args) -> dict:
    from omnirt.app.cli import build_parser, engine_options
    from omnirt.pipeline.serving.core import build_engine

    engine = build_engine(engine_options(build_parser().parse_args(["serve", *args.serve_args])))
    prompts = [f"Request number {i}: " + "tell me something " * (3 + 5 * i) for i in range(args.num_requests)]
    in_place = engine.models.thinker.kv.in_place
    top2 = record_top2(engine)
    graphed, t_graph = await run_all(engine, prompts, "graph", args.thinker_tokens, args.frames)
    m = engine.models
    compiled = {c.name: round(getattr(c.fn, "seconds", 0.0), 1)
                for c in (m.thinker.cuda_graphs, m.talker.decode_graphs, m.talker.predictor_graphs)}
    plain_path(engine)
    eager, t_eager = await run_all(engine, prompts, "eager", args.thinker_tokens, args.frames)
    engine.stop()
    same_text = sum(g[0] == e[0] for g, e in zip(graphed, eager))
    first_diff = [next((k for k, (a, b) in enumerate(zip(g[0], e[0])) if a != b), None)
                  for g, e in zip(graphed, eager)]
    audio_err = [float(np.abs(g[1][: len(e[1])] - e[1][: len(g[1])]).max()) if len(g[1]) and len(e[1]) else None
                 for g, e in zip(graphed, eager)]
    t = engine.models.thinker.cuda_graphs
    return {"requests": len(prompts), "identical_text": same_text, "first_token_diff": first_diff,
            "audio_max_abs_diff": audio_err,
            "audio_len_equal": [len(g[1]) == len(e[1]) for g, e in zip(graphed, eager)],
            "seconds_graphed": t_graph, "seconds_eager": t_eager, "attention_in_place": in_place,
            "compile_seconds": compiled,
            "thinker_graphs": len(t), "thinker_replays": t.num_replays,
            "prefill_graphs": {m.prefill.name: (len(m.prefill.cuda_graphs), m.prefill.cuda_graphs.num_replays)
                               for m in (engine.models.thinker, engine.models.talker)},
            "divergence": {stage: [divergence(rows, i) for i in range(len(prompts))] for stage, rows in top2.items()
                           if rows}}


def cli(doc: str, options: dict[str, tuple[type, object, str]], run) -> None:
    """A check's command line: its `options` (name -> type, default, help), then `omnirt serve`'s arguments
    after --; prints the JSON that `run(args)` (a coroutine function) returns."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, (kind, default, text) in options.items():
        p.add_argument(name, type=kind, default=default, help=text)
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments of `omnirt serve` after --")
    args = p.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    print(json.dumps(asyncio.run(run(args)), indent=1))


def main() -> None:
    cli(__doc__, {"--num-requests": (int, 6, "prompts"), "--thinker-tokens": (int, 16, "text tokens per reply"),
                  "--frames": (int, 24, "codec frames per reply")}, main_async)


if __name__ == "__main__":
    main()
