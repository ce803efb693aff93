"""What constrained decoding costs at the released model's vocabulary (151,936 logits), and that it holds there.

Parts, each printed as one JSON line:
- `graph`: the mask applied inside a captured CUDA graph follows the mask copied in before each replay;
- `apply`: the device time of the sampler's mask (`apply_token_bitmask`) + argmax against argmax alone, per
  batch of 1/16/64 rows (CUDA events, median of 200);
- `fill`: the host time of filling one bitmask row per constrained request and advancing its matcher, per step,
  for 1/16/64 rows of a JSON-schema constraint. The full-size dummy checkpoint has no Qwen tokenizer, so the
  grammar sees a synthetic vocabulary of the released size (byte-level-like tokens made here): a stand-in for
  the real table, labelled as such;
- `serve` (with --url): a served model answering N concurrent chat requests free, with a `json_schema`
  response format, and with `tool_choice: "required"`: wall time, completion tokens per second, and how many
  outputs are valid JSON matching the schema.

python3 -m omnirt.loadtest.gpu.grammar_check [--url http://127.0.0.1:8091 --model M --concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time

import torch

from omnirt.pipeline.stage.grammar import BITS, GrammarMasks, Grammars, apply_token_bitmask

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}}]


def emit(part: str, **fields) -> None:
    print(json.dumps({"part": part, **fields}), flush=True)


def graph_check(device: str) -> None:
    logits = torch.randn(4, VOCAB, device=device)
    mask = torch.full((4, (VOCAB + BITS - 1) // BITS), -1, dtype=torch.int32, device=device)
    out = apply_token_bitmask(logits, mask)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_token_bitmask(logits, mask)
    mask.copy_(replay_mask(mask.shape))
    graph.replay()
    rows = [torch.isfinite(out[i]).nonzero().flatten().tolist() for i in (0, 2)]
    emit("graph", ok=rows == [[1, 2], [VOCAB - 1]] and bool(torch.isfinite(out[1]).all()))


def replay_mask(shape) -> torch.Tensor:
    """Row 0: tokens 1 and 2; row 1: all; rows 2, 3: the last token only (bit 31 of its word: the sign bit)."""
    host = torch.zeros(shape, dtype=torch.int32)
    host[0, 0], host[1] = 0b110, -1
    bit = (VOCAB - 1) % BITS
    host[2:, (VOCAB - 1) // BITS] = (1 << bit) - (1 << 32 if bit == BITS - 1 else 0)
    return host


def device_ms(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def apply_cost(device: str) -> None:
    for rows in (1, 16, 64):
        logits = torch.randn(rows, VOCAB, device=device)
        mask = torch.randint(-2**31, 2**31 - 1, (rows, (VOCAB + BITS - 1) // BITS), dtype=torch.int32, device=device)
        free = device_ms(lambda x=logits: x.argmax(-1))
        masked = device_ms(lambda x=logits, m=mask: apply_token_bitmask(x, m).argmax(-1))
        emit("apply", rows=rows, argmax_ms=round(free, 4), masked_ms=round(masked, 4),
             mask_cost_ms=round(masked - free, 4))


def synthetic_grammars() -> Grammars:
    """Grammars over a synthetic vocabulary of the released size: every byte, then pieces of words."""
    import xgrammar as xgr

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " _-.,:;\"{}[]"
    vocab = [chr(b) for b in range(32, 127)]
    seen = set(vocab)
    while len(vocab) < VOCAB - 300:
        piece = ("" if rng.random() < .5 else " ") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    vocab += [f"<|special_{i}|>" for i in range(VOCAB - len(vocab))]
    grammars = Grammars(None, VOCAB, [VOCAB - 1])
    grammars._info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=VOCAB,
                                       stop_token_ids=[VOCAB - 1])
    return grammars


def fill_cost(steps: int = 30) -> None:
    grammars = synthetic_grammars()
    start = time.perf_counter()
    constraint = grammars.compile({"type": "json_schema", "schema": SCHEMA})
    emit("compile", ms=round((time.perf_counter() - start) * 1000, 1), vocab=VOCAB)
    for rows in (1, 16, 64):
        constraints = [grammars.compile({"type": "json_schema", "schema": SCHEMA}) for _ in range(rows)]
        masks, fill_s, accept_s, done = GrammarMasks(grammars), 0.0, 0.0, 0
        logits = torch.randn(rows, VOCAB)
        while done < steps:
            done += 1
            t0 = time.perf_counter()
            mask = masks.fill(constraints)
            t1 = time.perf_counter()
            tokens = apply_token_bitmask(logits, mask).argmax(-1).tolist()
            t2 = time.perf_counter()
            if any(t == VOCAB - 1 for t in tokens):
                break
            masks.accept(constraints, tokens)
            fill_s, accept_s = fill_s + t1 - t0, accept_s + time.perf_counter() - t2
            logits = torch.randn(rows, VOCAB)
        emit("fill", rows=rows, steps=done, fill_ms_per_step=round(fill_s * 1000 / done, 3),
             accept_ms_per_step=round(accept_s * 1000 / done, 3))
    del constraint


async def serve_round(url: str, model: str, n: int, extra: dict) -> dict:
    import httpx
    import jsonschema

    body = {"model": model, "max_tokens": 120, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather like in Paris for the next days?"}]}

    async def one(client, i: int):
        r = await client.post(f"{url}/v1/chat/completions", json={**body, **extra, "seed": i})
        return r.json()

    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*[one(client, i) for i in range(n)])
        wall = time.perf_counter() - start
    counts = [o.get("usage", {}).get("completion_tokens", 0) for o in outs]
    tokens, valid = sum(counts), 0
    for out in outs:
        try:
            msg = out["choices"][0]["message"]
            text = msg["tool_calls"][0]["function"]["arguments"] if "tools" in extra else msg["content"]
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (KeyError, IndexError, TypeError, ValueError, jsonschema.ValidationError):
            pass
    return {"requests": n, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1), "valid": valid,
            "errors": sum("error" in o for o in outs), "longest_tokens": max(counts),
            "ms_per_step": round(wall * 1000 / max(max(counts), 1), 1)}  # the longest reply paces the round


def serve(url: str, model: str, n: int) -> None:
    rounds = {"free": {}, "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": SCHEMA, "strict": True}}}, "tool_required": {"tools": TOOLS,
                                                                                   "tool_choice": "required"}}
    for name, extra in rounds.items():
        asyncio.run(serve_round(url, model, 4, extra))  # warm-up: the grammar compiled, its tables built
        emit("serve", mode=name, **asyncio.run(serve_round(url, model, n, extra)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--model", default="qwen3-omni-30b-a3b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--skip-kernels", action="store_true", help="only the served part")
    args = ap.parse_args()
    if not args.skip_kernels:
        if torch.cuda.is_available():
            graph_check("cuda")
            apply_cost("cuda")
        fill_cost()
    if args.url:
        serve(args.url, args.model, args.concurrency)


if __name__ == "__main__":
    main()
