"""What a server's `--step-log` says about a run: per stage and kind of step (prefill, decode), the steps,
the requests and tokens in them and their milliseconds, over each span of the run (a bench point), as a
markdown table; optionally a plot of prefill step time against tokens and of the requests per prefill step
over time.

    python -m omnirt.loadtest.step_log STEPS.log[.gz] [--spans CALL.log] [--plot OUT.png]

`--spans` reads lines "NAME from T" / "NAME until T" (wall-clock seconds, as the GPU driver's `points` scenario
prints them around each point); without it the whole log is one span.
"""

from __future__ import annotations

import argparse
import gzip
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnirt.loadtest import plot

STAGES = ("thinker", "talker", "code2wav")
KINDS = ("prefill", "decode")
_SPAN = re.compile(r"^(\S+) (from|until) (\d+(?:\.\d+)?)\s*$")


@dataclass(frozen=True, slots=True)
class Step:
    at: float  # wall-clock seconds when it ended
    stage: str
    kind: str
    rows: int
    tokens: int
    ms: float


def read_steps(path: Path) -> list[Step]:
    """The steps of a log, plain or gzipped (.gz)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    out = []
    for line in text.splitlines():
        at, stage, kind, rows, tokens, ms = line.split()
        out.append(Step(float(at), stage, kind, int(rows), int(tokens), float(ms)))
    return out


def read_spans(path: Path) -> list[tuple[str, float, float]]:
    """(name, from, until) per span, in order, each name led by the span's place ("1-32", "2-64", "3-32": a point
    may come twice)."""
    spans, open_at = [], {}
    for line in path.read_text().splitlines():
        m = _SPAN.match(line)
        if m and m.group(2) == "from":
            open_at[m.group(1)] = float(m.group(3))
        elif m and m.group(1) in open_at:
            spans.append((f"{len(spans) + 1}-{m.group(1)}", open_at.pop(m.group(1)), float(m.group(3))))
    return spans


def summarize(steps: list[Step]) -> list[dict]:
    """A row per stage and kind that has steps: steps, mean and most requests, mean tokens, ms p50 / p90 / max."""
    rows = []
    for stage in STAGES:
        for kind in KINDS:
            sel = [s for s in steps if s.stage == stage and s.kind == kind]
            if not sel:
                continue
            ms = np.array([s.ms for s in sel])
            rows.append({"stage": stage, "kind": kind, "steps": len(sel),
                         "rows_mean": float(np.mean([s.rows for s in sel])), "rows_max": max(s.rows for s in sel),
                         "tokens_mean": float(np.mean([s.tokens for s in sel])),
                         "ms_p50": float(np.percentile(ms, 50)), "ms_p90": float(np.percentile(ms, 90)),
                         "ms_max": float(ms.max())})
    return rows


def in_span(steps: list[Step], start: float, end: float) -> list[Step]:
    return [s for s in steps if start <= s.at <= end]


def markdown(spans: list[tuple[str, list[Step]]]) -> str:
    out = ["| span | stage | kind | steps | requests a step (max) | tokens a step | ms p50 / p90 / max |\n"
           "|---|---|---|---|---|---|---|\n"]
    for name, steps in spans:
        out += [f"| {name} | {r['stage']} | {r['kind']} | {r['steps']} | {r['rows_mean']:.2f} ({r['rows_max']}) | "
                f"{r['tokens_mean']:.1f} | {r['ms_p50']:.1f} / {r['ms_p90']:.1f} / {r['ms_max']:.1f} |\n"
                for r in summarize(steps)]
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omnirt.loadtest.step_log", description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="the file the server's --step-log wrote")
    p.add_argument("--spans", type=Path, help="a file with 'NAME from T' / 'NAME until T' lines")
    p.add_argument("--plot", type=Path, help="where to draw the Thinker's prefill steps (png)")
    args = p.parse_args(argv)
    steps = read_steps(args.log)
    spans = ([(name, in_span(steps, a, b)) for name, a, b in read_spans(args.spans)] if args.spans
             else [("all", steps)])
    print(markdown(spans), end="")
    if args.plot:
        plot.prefill_steps(spans, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
