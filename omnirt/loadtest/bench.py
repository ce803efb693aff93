"""`omnirt bench`: drive a live server over HTTP exactly like a client and report req/s, TTFP, RTF, underruns.

Each request is a streaming chat completion with `modalities ["text", "audio"]`. A point is c workers, each a
closed loop (`omnirt/loadtest/closed_loop.py`): after a warm-up, a measured window of steady state. Prompts are
distinct random text whose lengths follow a stated distribution (`omnirt/loadtest/chat_requests.py`), the Thinker
samples (temperature 0.7, top-p 0.8, top-k 20) so that rows spread over the experts as real traffic does. `--wave`
(one wave of requests a point), `--repeat-prompt` (one prompt for all of a point) and greedy sampling are the older
shapes, kept as diagnostics and labelled so in every table, JSON row and plot. Reply lengths can be pinned
(`min_tokens` = `max_tokens` for the Thinker and the Talker) so that runs compare even with random weights.
Definitions (docs/benchmarks.md): TTFP = send -> first audio delta; RTF = (last audio delta - send) / audio
seconds; underrun = the listener's buffer, filled from the first packet on, runs dry for >= 100 ms while audio is
still owed. Each point also reads from the server's /metrics, over its window, the rows each stage's steps held
(mean and p90) and where first packets' time went (each stage's mean time from submission to its first output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import time
from pathlib import Path

import aiohttp
import httpx

from omnirt.loadtest import local_server, plot, server_metrics
from omnirt.loadtest.chat_requests import Prompts, calibrate, one_request, parse_lengths, request_body, words_for
from omnirt.loadtest.closed_loop import Plan, Window
from omnirt.loadtest.stats import NOTE, summary

STAGES = ("thinker", "talker", "code2wav")


def labels(args: argparse.Namespace) -> dict:
    """How a point's load was shaped, each diagnostic shape labelled so; and the list of those."""
    out = {"load": "wave (diagnostic)" if args.wave else "steady",
           "prompts": "repeated (diagnostic)" if args.repeat_prompt else "distinct",
           "sampling": "greedy (diagnostic)" if args.temperature == 0 else
                       f"T {args.temperature:g}, top-p {args.top_p:g}, top-k {args.top_k}"}
    names = {"load": "wave", "prompts": "repeated prompt", "sampling": "greedy"}
    return {**out, "diagnostic": [names[k] for k, v in out.items() if "diagnostic" in v]}


def summarize(window: Window, point: dict) -> dict:
    """A point's row: throughput over the window, latencies of the replies measured in it."""
    done = [r.sample for r in window.completed()]
    samples = [r.sample for r in window.measured()]
    ok = [s for s in samples if s.ok and s.ttfp_s is not None]
    ttfp, gaps = summary(s.ttfp_s * 1000 for s in ok), summary(g * 1000 for s in ok for g in s.gaps_s)
    tokens = summary(s.prompt_tokens for s in ok)
    per_worker = window.per_worker()
    return {**point, "window_s": window.length_s, "requests": len(samples), "ok": len(ok),
            "failed": len(samples) - len(ok), "per_worker_min": min(per_worker, default=0),
            "req_per_s": sum(s.ok for s in done) / window.length_s if window.length_s else 0.0,
            "ttfp_mean_ms": statistics.fmean(s.ttfp_s * 1000 for s in ok) if ok else None,
            **{f"ttfp_{k}_ms": ttfp[k] for k in ("p50", "p90", "p99", "max")},
            "rtf_mean": statistics.fmean(s.rtf for s in ok) if ok else None,
            "ttft_mean_ms": statistics.fmean(s.ttft_s * 1000 for s in ok if s.ttft_s) if ok else None,
            "gap_p99_ms": gaps["p99"], "gap_max_ms": gaps["max"], "num_gaps": gaps["n"],
            "underruns": sum(s.underruns for s in ok), "underrun_requests": sum(s.underruns > 0 for s in ok),
            "audio_s_mean": statistics.fmean(s.audio_s for s in ok) if ok else None,
            "prompt_tokens": {"p50": tokens["p50"], "min": min((s.prompt_tokens for s in ok), default=None),
                              "max": tokens["max"]},
            "errors": sorted({s.error for s in samples if s.error})[:3]}


def engine_row(window: Window) -> dict:
    """What the server's /metrics say of the window: first outputs per stage, steps, rows a step per stage (mean and
    p90, from the engine's batch-size histogram)."""
    before, after = window.edges
    engine = server_metrics.engine_counters(after, before)
    return {"first_output_ms": server_metrics.first_output_ms(server_metrics.first_outputs(after),
                                                              server_metrics.first_outputs(before)),
            "engine": engine, "rows_per_step": server_metrics.batch_sizes(after, before)}


async def sweep(args: argparse.Namespace) -> list[dict]:
    results, shape, load = [], labels(args), load_plan(args)
    points, t0 = [(p, c) for p in args.prompt_lens for c in args.concurrency], time.perf_counter()
    scrape = server_metrics.settled_scrape if args.wave else server_metrics.scrape  # steady: the load goes on
    async with _session(max(args.concurrency) + 8, args.timeout) as client:
        prompts = Prompts(args.seed, words_for(*await calibrate(client, args.url, args.model)))
        for spec in args.prompt_lens:
            lengths = parse_lengths(spec)
            for c in args.concurrency:
                send = _sender(client, args, prompts, lengths)
                window = await load.run(send, c, lambda: asyncio.to_thread(scrape, args.url))
                row = {**summarize(window, {"prompt_len": spec, "concurrency": c, **shape, "seed": args.seed}),
                       **engine_row(window)}
                results.append(row)
                print(format_row(row), flush=True)
                _progress(len(results), len(points), time.perf_counter() - t0)
    return results


def _sender(client: aiohttp.ClientSession, args: argparse.Namespace, prompts: Prompts, lengths: tuple[int, int]):
    """A point's requests: each with a prompt of its own, or with --repeat-prompt all with the point's one."""
    repeated = prompts.next(lengths) if args.repeat_prompt else None

    async def send():
        text = repeated if args.repeat_prompt else prompts.next(lengths)
        return await one_request(client, args.url, request_body(args, text))

    return send


def _session(max_connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """The client of a sweep: aiohttp, whose per-stream cost stays small at c=64 (httpx's added 20-30 ms to a
    mean first packet at c=64 on a 2-core host, `python -m omnirt.loadtest.http_clients`); a 4 MiB line limit holds
    the largest SSE event (a 2 s audio chunk is 128 KiB of base64)."""
    connector = aiohttp.TCPConnector(limit=max_connections)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 read_bufsize=2**22)


def _progress(done: int, total: int, elapsed_s: float) -> None:
    if done < total:
        print(f"  point {done}/{total} after {elapsed_s:.0f} s; about {elapsed_s / done * (total - done):.0f} s "
              "left at this pace (later points run more clients)", flush=True)


# (key, title, format[, the key shown as "max X" where the sample is too small for the percentile])
COLUMNS = [("prompt_len", "prompt tokens", "{}"), ("prompts", "prompts", "{}"), ("concurrency", "c", "{}"),
           ("load", "load", "{}"), ("sampling", "sampling", "{}"), ("window_s", "window s", "{:.1f}"),
           ("ok", "ok", "{}"), ("req_per_s", "req/s", "{:.2f}"), ("ttfp_p50_ms", "TTFP p50 ms", "{:.0f}"),
           ("ttfp_p90_ms", "TTFP p90", "{:.0f}", "ttfp_max_ms"), ("ttfp_p99_ms", "TTFP p99", "{:.0f}", "ttfp_max_ms"),
           ("rtf_mean", "RTF", "{:.3f}"), ("underruns", "underruns", "{}"),
           ("rows_per_step", "rows a step, mean (p90): thinker / talker / code2wav", lambda v: _rows_cell(v)),
           ("ttft_mean_ms", "TTFT ms", "{:.0f}"), ("gap_p99_ms", "gap p99 ms", "{:.0f}", "gap_max_ms"),
           ("audio_s_mean", "audio s", "{:.1f}"), ("prompt_tokens", "prompt tokens sent: p50 (min-max)",
                                                   lambda v: _tokens_cell(v)),
           ("first_output_ms", "engine: first output per stage, mean ms", server_metrics.first_output_cell)]


def _rows_cell(sizes: dict[str, dict[str, float]]) -> str:
    return " / ".join(f"{sizes[s]['mean']:.1f} ({sizes[s]['p90']:.0f})" if s in sizes else "-" for s in STAGES)


def _tokens_cell(t: dict) -> str:
    return "-" if t.get("p50") is None else f"{t['p50']} ({t['min']}-{t['max']})"


def _value(row: dict, key: str, fmt, fallback: str | None = None) -> str:
    """A cell: the value; a percentile with too few samples as the maximum, labelled so; '-' for none."""
    if row.get(key) is not None:
        return fmt(row[key]) if callable(fmt) else fmt.format(row[key])
    if fallback and row.get(fallback) is not None:
        return "max " + fmt.format(row[fallback])
    return "-"


def format_row(row: dict) -> str:
    return " | ".join(f"{col[1]} " + _value(row, col[0], *col[2:]) for col in COLUMNS)


def markdown(rows: list[dict], title: str) -> str:
    head = "| " + " | ".join(col[1] for col in COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(_value(r, col[0], *col[2:]) for col in COLUMNS) + " |\n" for r in rows)
    engine = "".join(f"- prompt {r['prompt_len']}, c={r['concurrency']}, engine steps over the window: "
                     f"{server_metrics.engine_cell(r['engine'])}\n" for r in rows if r.get("engine"))
    diagnostic = sorted({d for r in rows for d in r.get("diagnostic", [])})
    caveat = (f"**Diagnostic** ({', '.join(diagnostic)}): not the steady state of distinct, sampled traffic; "
              "for comparison with older figures only.\n\n" if diagnostic else "")
    seeds = sorted({r["seed"] for r in rows if r.get("seed") is not None})
    drawn = f"Prompts drawn with seed {', '.join(map(str, seeds))} (`--seed` draws them again).\n" if seeds else ""
    return f"### {title}\n\n{caveat}{head}{body}\n{engine}\n{drawn}{NOTE}\n"


def server_args(p: argparse.ArgumentParser) -> None:
    """The flags both benches take to reach a server, and where their report goes."""
    p.add_argument("--url", default="http://127.0.0.1:8091", help="the running server")
    p.add_argument("--model", default="tiny", help="the served model id")
    p.add_argument("--voice", default="ethan", help="the voice replies are spoken in")
    p.add_argument("--out", default=None, help="folder for NAME.json, NAME.md and NAME.png (default: "
                   "bench-results/NAME-<date>-<time>/, a run folder git ignores)")
    p.add_argument("--dry-run", action="store_true", help="say what would run against this server, and stop")
    local_server.add_args(p)


def server_platform(url: str) -> str:
    """Where the server's engine runs (its /health), to pick a sweep that fits it."""
    try:
        return httpx.get(f"{url}/health", timeout=10).json().get("platform", "cpu")
    except (httpx.HTTPError, ValueError) as exc:
        raise SystemExit(f"omnirt bench: no server answers at {url}/health ({exc}); start one with `omnirt serve` "
                         "or pass --url") from exc


def write_report(args: argparse.Namespace, rows: list[dict], markdown, plot) -> None:
    """NAME.json (arguments and rows), NAME.md and NAME.png under --out; the table to stdout."""
    out = Path(args.out or f"bench-results/{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    (out / f"{args.name}.md").write_text(markdown(rows, args.name))
    plot(rows, out / f"{args.name}.png", args.name)
    print(markdown(rows, args.name))
    print(f"report: {out}/{args.name}.md (.json, .png)")


# The points when none are given: on an accelerator, a spread of prompt lengths at three concurrencies; on a CPU,
# a small one that finishes in minutes. Prompt lengths in whole-prompt tokens: N, or LO-HI (log-uniform).
SWEEPS = {"cpu": (["16-160"], [1, 2, 4]), "gpu": (["16-640"], [1, 16, 64])}
WAVE_ONLY = {"requests_per_point": 8, "rounds": 2, "warmup": 4}  # --wave's flags, and their defaults


def build_parser() -> argparse.ArgumentParser:
    from omnirt.app.flags import HelpFormatter

    p = argparse.ArgumentParser(prog="omnirt bench", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    server_args(p)
    cpu, gpu = SWEEPS["cpu"], SWEEPS["gpu"]
    p.add_argument("--prompt-lens", nargs="+", default=None, help="prompt lengths in tokens, system prompt included: "
                   "N (each about N), or LO-HI (log-uniform between them); one sweep point each (default: "
                   f"{' '.join(gpu[0])} on an accelerator, {' '.join(cpu[0])} on a CPU server)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed-loop workers per point (default: "
                   f"{' '.join(map(str, gpu[1]))} on an accelerator, {' '.join(map(str, cpu[1]))} on a CPU server)")
    p.add_argument("--warmup-s", type=float, default=20, help="seconds of load before each window, not measured")
    p.add_argument("--window-s", type=float, default=60, help="the measured window's least length in seconds")
    p.add_argument("--min-requests", type=int, default=8,
                   help="the window goes on until each worker completed this many requests started in it")
    p.add_argument("--seed", type=int, default=None, help="draws the prompts (default: a new one, in the report)")
    p.add_argument("--temperature", type=float, default=0.7, help="the Thinker's sampling temperature (0: greedy, "
                   "a diagnostic: every reply takes the same experts)")
    p.add_argument("--top-p", type=float, default=0.8, help="the Thinker's top-p (unless greedy)")
    p.add_argument("--top-k", type=int, default=20, help="the Thinker's top-k (unless greedy)")
    p.add_argument("--greedy", dest="temperature", action="store_const", const=0.0, help="--temperature 0")
    p.add_argument("--thinker-tokens", type=int, default=40, help="text tokens per reply")
    p.add_argument("--talker-frames", type=int, default=145, help="codec frames per reply (80 ms each)")
    p.add_argument("--fixed-lengths", action=argparse.BooleanOptionalAction, default=True,
                   help="pin reply lengths (min_tokens = max_tokens) so that runs compare, even with random weights")
    p.add_argument("--repeat-prompt", action="store_true", help="diagnostic: every request of a point sends the "
                   "same prompt (the server reuses its prefix)")
    p.add_argument("--wave", action="store_true", help="diagnostic: instead of a steady window, warm-up requests "
                   "and then one wave of requests a point (--requests-per-point, --rounds, --warmup)")
    p.add_argument("--requests-per-point", type=int, help=f"--wave: at least this many requests per point "
                   f"(default {WAVE_ONLY['requests_per_point']})")
    p.add_argument("--rounds", type=int, help=f"--wave: requests per worker (default {WAVE_ONLY['rounds']})")
    p.add_argument("--warmup", type=int, help=f"--wave: requests before each point, not counted "
                   f"(default {WAVE_ONLY['warmup']})")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--name", default="bench", help="the report's name")
    return p


def load_plan(args: argparse.Namespace) -> Plan:
    return Plan(args.wave, args.warmup_s, args.window_s, args.min_requests, args.warmup, args.requests_per_point,
                args.rounds)


def plan(args: argparse.Namespace) -> argparse.Namespace:
    """Check the flags, fill in the sweep for the server's platform and the seed, and say what will run."""
    if given := [f"--{k.replace('_', '-')}" for k in WAVE_ONLY if getattr(args, k) is not None and not args.wave]:
        raise SystemExit(f"omnirt bench: {', '.join(given)}: only with --wave; without it each point is a steady "
                         "window (--warmup-s, --window-s, --min-requests)")
    for k, default in WAVE_ONLY.items():
        setattr(args, k, default if getattr(args, k) is None else getattr(args, k))
    for spec in args.prompt_lens or ():
        parse_lengths(spec)
    platform = server_platform(args.url)
    lens, conc = SWEEPS["cpu" if platform == "cpu" else "gpu"]
    args.prompt_lens, args.concurrency = args.prompt_lens or lens, args.concurrency or conc
    args.seed = secrets.randbelow(2**31) if args.seed is None else args.seed
    shape = labels(args)
    if args.wave:
        num = sum(args.warmup + max(args.requests_per_point, c * args.rounds) for c in args.concurrency)
        load = f"one wave a point, {num * len(args.prompt_lens)} requests in all"
    else:
        load = (f"a closed loop a worker: {args.warmup_s:g} s of warm-up, then a window of >= {args.window_s:g} s "
                f"and >= {args.min_requests} requests a worker, at each point")
    points = f"prompt lengths {' '.join(args.prompt_lens)} tokens x concurrency {' '.join(map(str, args.concurrency))}"
    say_plan(args, f"{platform} server at {args.url}: {points} (--prompt-lens, --concurrency to change); {load}; "
             f"prompts {shape['prompts']}, seed {args.seed}; sampling {shape['sampling']}; replies of "
             f"{args.thinker_tokens} tokens and {args.talker_frames * 0.08:.1f} s of speech")
    return args


def say_plan(args: argparse.Namespace, plan_text: str) -> None:
    """Print what will run; with --dry-run, only that."""
    print(f"{'would run' if args.dry_run else 'running'}: {plan_text}", flush=True)
    if args.dry_run:
        raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with local_server.serving(args):
        args = plan(args)
        write_report(args, asyncio.run(sweep(args)), markdown, plot.chat)


if __name__ == "__main__":
    main()
