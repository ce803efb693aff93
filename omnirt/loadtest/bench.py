"""`omnirt bench`: drive a live server over HTTP exactly like a client and report TTFP, RTF, req/s.

Each request is a streaming chat completion with `modalities ["text", "audio"]`. A sweep point is a
closed loop at concurrency c (c workers, each sending its next request when the last one ends),
after warm-up requests. StageOutput lengths can be pinned (`min_tokens` = `max_tokens` for the Thinker and
the Talker) so that runs compare even with random weights. Definitions (docs/benchmarks.md):
TTFP = send -> first audio delta; RTF = (last audio delta - send) / audio seconds; underrun = the
listener's buffer, filled from the first packet on, runs dry for >= 100 ms while audio is still owed.
Each point also reads from the server's /metrics where its first packets' time went: the engine's mean
time from a request's submission to each stage's first output (first token, frame, PCM).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import secrets
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from omnirt.app.audio.playback import PlaybackClock, pcm16_seconds
from omnirt.app.audio.wire import PCM16
from omnirt.loadtest import local_server, plot, server_metrics
from omnirt.loadtest.stats import NOTE, summary


@dataclass(slots=True)
class Sample:
    ok: bool = False
    ttft_s: float | None = None
    ttfp_s: float | None = None
    latency_s: float = 0.0
    audio_s: float = 0.0
    rtf: float | None = None
    max_gap_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    underruns: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def _underruns(arrivals: list[tuple[float, float]]) -> int:
    """arrivals: (time since send, seconds of audio in the packet), through the server's own playback clock."""
    clock = PlaybackClock()
    for t, dur in arrivals:
        clock.on_packet(t, dur)
    return clock.num_underruns


async def one_request(client: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    s, arrivals, t0 = Sample(), [], time.perf_counter()
    try:
        async with client.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return s
            async for raw in r.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter() - t0
                if chunk.get("usage"):
                    s.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    audio = choice["delta"].get("audio") or {}
                    has_text = audio.get("transcript") is not None or choice["delta"].get("content") is not None
                    if has_text and s.ttft_s is None and choice["delta"].get("role") is None:
                        s.ttft_s = now
                    if audio.get("data"):
                        dur = pcm16_seconds(base64.b64decode(audio["data"]), PCM16.sample_rate)
                        arrivals.append((now, dur))
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return s
    s.latency_s = time.perf_counter() - t0
    if arrivals:
        s.ttfp_s = arrivals[0][0]
        s.audio_s = sum(d for _, d in arrivals)
        s.rtf = arrivals[-1][0] / s.audio_s
        s.gaps_s = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
        s.max_gap_s = max(s.gaps_s, default=0.0)
        s.underruns = _underruns(arrivals)
    s.ok = s.error is None
    return s


def serial_numbers() -> Iterator[int]:
    """A run's request serials (--distinct-prompts), from a random start: the prompts of a later run on the same
    server are not those of this one, which it would find resident and reuse (an earlier run's serials from 0 made
    a second run's c=64 point reuse 141 of each prompt's 142 tokens: 320 ms to the first packet against 710)."""
    return itertools.count(secrets.randbelow(10**9) * 10**3)


def request_body(args: argparse.Namespace, words: int, serial: int = 0) -> dict:
    """A streaming chat request of `words` words; with --distinct-prompts its first word is `serial`, so that no two
    requests of a run share more than the system prompt (prefix reuse then finds no whole prompt to reuse)."""
    text = [str(serial)] + ["hello"] * max(words - 1, 1) if args.distinct_prompts else ["hello"] * max(words, 1)
    body = {"model": args.model, "stream": True, "stream_options": {"include_usage": True},
            "modalities": ["text", "audio"], "audio": {"voice": args.voice, "format": "pcm16"},
            "messages": [{"role": "user", "content": " ".join(text)}],
            "max_tokens": args.thinker_tokens, "temperature": 0.0}
    if args.fixed_lengths:
        body["min_tokens"] = args.thinker_tokens
        body["talker_sampling"] = {"max_tokens": args.talker_frames + 1, "min_tokens": args.talker_frames + 1}
    return body


async def calibrate(client: aiohttp.ClientSession, url: str, model: str, target: int) -> int:
    """How many prompt words give `target` prompt tokens on this server (system prompt included)."""
    async def count(words: int) -> int:
        async with client.post(f"{url}/v1/chat/completions", raise_for_status=True, json={
                "model": model, "max_tokens": 1,
                "messages": [{"role": "user", "content": " ".join(["hello"] * words)}]}) as r:
            return (await r.json())["usage"]["prompt_tokens"]

    base, per = await count(1), (await count(101) - await count(1)) / 100
    return max(1, round(1 + (target - base) / max(per, 1e-6)))


async def run_point(client, args, words: int, concurrency: int, num_requests: int,
                    serials: Iterator[int]) -> tuple[list[Sample], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    samples: list[Sample] = []

    async def worker():
        while not queue.empty():
            queue.get_nowait()
            samples.append(await one_request(client, args.url, request_body(args, words, next(serials))))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


def summarize(samples: list[Sample], wall_s: float, prompt_len: int, concurrency: int) -> dict:
    ok = [s for s in samples if s.ok and s.ttfp_s is not None]
    ttfp = summary(s.ttfp_s * 1000 for s in ok)
    gaps = summary(g * 1000 for s in ok for g in s.gaps_s)
    return {"prompt_len": prompt_len, "concurrency": concurrency, "requests": len(samples), "ok": len(ok),
            "failed": len(samples) - len(ok), "req_per_s": len(ok) / wall_s if wall_s else 0.0,
            "ttfp_mean_ms": statistics.fmean(s.ttfp_s * 1000 for s in ok) if ok else None,
            "ttfp_p50_ms": ttfp["p50"], "ttfp_p99_ms": ttfp["p99"], "ttfp_max_ms": ttfp["max"],
            "rtf_mean": statistics.fmean(s.rtf for s in ok) if ok else None,
            "ttft_mean_ms": statistics.fmean(s.ttft_s * 1000 for s in ok if s.ttft_s) if ok else None,
            "gap_p99_ms": gaps["p99"], "gap_max_ms": gaps["max"], "num_gaps": gaps["n"],
            "underruns": sum(s.underruns for s in ok),
            "audio_s_mean": statistics.fmean(s.audio_s for s in ok) if ok else None,
            "prompt_tokens": ok[0].prompt_tokens if ok else None,
            "errors": sorted({s.error for s in samples if s.error})[:3]}


async def sweep(args: argparse.Namespace) -> list[dict]:
    results = []
    points, t0 = [(p, c) for p in args.prompt_lens for c in args.concurrency], time.perf_counter()
    serials = serial_numbers()  # of every request of the run (--distinct-prompts)
    async with _session(max(args.concurrency) + 8, args.timeout) as client:
        for prompt_len in args.prompt_lens:
            words = await calibrate(client, args.url, args.model, prompt_len)
            for c in args.concurrency:
                await run_point(client, args, words, min(c, args.warmup), args.warmup, serials)
                n = max(args.requests_per_point, c * args.rounds)
                before = await asyncio.to_thread(server_metrics.settled_scrape, args.url)
                samples, wall = await run_point(client, args, words, c, n, serials)
                after = await asyncio.to_thread(server_metrics.settled_scrape, args.url)
                row = {**summarize(samples, wall, prompt_len, c), "first_output_ms": server_metrics.first_output_ms(
                    server_metrics.first_outputs(after), server_metrics.first_outputs(before)),
                    "engine": server_metrics.engine_counters(after, before)}
                results.append(row)
                print(format_row(row), flush=True)
                _progress(len(results), len(points), time.perf_counter() - t0)
    return results


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
COLUMNS = [("prompt_len", "prompt", "{}"), ("concurrency", "c", "{}"), ("ok", "ok", "{}"),
           ("req_per_s", "req/s", "{:.2f}"), ("ttfp_mean_ms", "TTFP mean ms", "{:.0f}"),
           ("ttfp_p50_ms", "TTFP p50", "{:.0f}"), ("ttfp_p99_ms", "TTFP p99", "{:.0f}", "ttfp_max_ms"),
           ("rtf_mean", "RTF", "{:.3f}"), ("ttft_mean_ms", "TTFT ms", "{:.0f}"),
           ("gap_p99_ms", "gap p99 ms", "{:.0f}", "gap_max_ms"), ("num_gaps", "gaps", "{}"),
           ("underruns", "underruns", "{}"), ("audio_s_mean", "audio s", "{:.1f}"),
           ("first_output_ms", "engine: first output per stage, mean ms", server_metrics.first_output_cell)]


def _value(row: dict, key: str, fmt: str, fallback: str | None = None) -> str:
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
    engine = "".join(f"- prompt {r['prompt_len']}, c={r['concurrency']}, engine steps over the point: "
                     f"{server_metrics.engine_cell(r['engine'])}\n" for r in rows if r.get("engine"))
    return f"### {title}\n\n{head}{body}\n{engine}\n{NOTE}\n"


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


# The sweep when none is given: the full one on an accelerator, a small one a CPU finishes in minutes.
SWEEPS = {"cpu": ([10, 160], [1, 2, 4]), "gpu": ([10, 160, 320, 640], [1, 16, 32, 64])}


def build_parser() -> argparse.ArgumentParser:
    from omnirt.app.flags import HelpFormatter

    p = argparse.ArgumentParser(prog="omnirt bench", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    server_args(p)
    cpu, gpu = SWEEPS["cpu"], SWEEPS["gpu"]
    p.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="prompt lengths in tokens (default: "
                   f"{' '.join(map(str, gpu[0]))} on an accelerator, {' '.join(map(str, cpu[0]))} on a CPU server)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="concurrent clients per point (default: "
                   f"{' '.join(map(str, gpu[1]))} on an accelerator, {' '.join(map(str, cpu[1]))} on a CPU server)")
    p.add_argument("--thinker-tokens", type=int, default=40, help="text tokens per reply")
    p.add_argument("--talker-frames", type=int, default=145, help="codec frames per reply (80 ms each)")
    p.add_argument("--fixed-lengths", action=argparse.BooleanOptionalAction, default=True,
                   help="pin reply lengths (min_tokens = max_tokens) so that runs compare, even with random weights")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="no two requests share more than the system prompt (by default all of a point's prompts are "
                        "the same, and the server reuses their prefixes)")
    p.add_argument("--requests-per-point", type=int, default=8, help="at least this many requests per point")
    p.add_argument("--rounds", type=int, default=2, help="requests per worker at each point")
    p.add_argument("--warmup", type=int, default=4, help="requests before each point, not counted")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--name", default="bench", help="the report's name")
    return p


def plan(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the sweep for the server's platform, and say what will run."""
    platform = server_platform(args.url)
    lens, conc = SWEEPS["cpu" if platform == "cpu" else "gpu"]
    args.prompt_lens, args.concurrency = args.prompt_lens or lens, args.concurrency or conc
    num = sum(args.warmup + max(args.requests_per_point, c * args.rounds) for c in args.concurrency)
    say_plan(args, f"{platform} server at {args.url}: prompt lengths {args.prompt_lens} x concurrency "
             f"{args.concurrency}, {num * len(args.prompt_lens)} requests of {args.thinker_tokens} tokens and "
             f"{args.talker_frames * 0.08:.1f} s of speech each (--prompt-lens, --concurrency to change)")
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
