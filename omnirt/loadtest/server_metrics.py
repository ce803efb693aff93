"""What the benchmarks read from the server's /metrics around a point: the API process's CPU seconds, the
prompt tokens each stage computed or reused, when each stage first served a request, and the engine's steps
(prefill and decode, their time, rows a step) and device allocations."""

from __future__ import annotations

import time

import httpx

# the engine core sends the API process a stats snapshot this often (omnirt/pipeline/serving/core.py)
STATS_PERIOD_S = 0.2


def scrape(url: str) -> list[str]:
    return httpx.get(f"{url}/metrics", timeout=10).text.splitlines()


def settled_scrape(url: str, tries: int = 10) -> list[str]:
    """/metrics once the engine's snapshot has caught up with what just ended (between points, nothing runs):
    the first-output counters the same in three scrapes, each a few snapshot periods after the last."""
    lines, same = scrape(url), 0
    for _ in range(tries):
        time.sleep(3 * STATS_PERIOD_S)
        again = scrape(url)
        same = same + 1 if first_outputs(again) == first_outputs(lines) else 0
        lines = again
        if same == 2:
            break
    return lines


def _summed(lines: list[str], name: str) -> float | None:
    """Metric `name`'s samples, with or without labels, added up (None: no sample)."""
    samples = [float(line.split()[-1]) for line in lines if line.startswith((name + " ", name + "{"))]
    return sum(samples) if samples else None


def cpu_seconds(lines: list[str]) -> float | None:
    """The API process's CPU seconds; with `--api-workers`, every worker's (one sample each) added up."""
    return _summed(lines, "process_cpu_seconds_total")


def _labelled(lines: list[str], name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric `name` with labels, as ({label: value}, sample value)."""
    out = []
    for line in lines:
        if line.startswith(name + "{"):
            labels, value = line[line.index("{") + 1:].split("} ")
            out.append(({k: v.strip('"') for k, v in (part.split("=") for part in labels.split(","))}, float(value)))
    return out


def prefill_tokens(lines: list[str]) -> dict[str, dict[str, float]]:
    """{stage: {"computed": n, "cached": n}} (empty before the first prefill)."""
    out: dict[str, dict[str, float]] = {}
    for tags, value in _labelled(lines, "omnirt_stage_prefill_tokens_total"):
        out.setdefault(tags["stage"], {})[tags["source"]] = value
    return out


def first_outputs(lines: list[str]) -> dict[str, tuple[float, float]]:
    """{stage: (requests, seconds summed)} from the engine's submission to the stage's first output, then
    {"api": ...}: the API process's own time to first audio (request handler -> first audio event), which
    adds the API's share (prompt parsing, the hand-off to and from the engine core) to the last stage's."""
    counts = {t["stage"]: v for t, v in _labelled(lines, "omnirt_stage_first_output_seconds_count")}
    sums = {t["stage"]: v for t, v in _labelled(lines, "omnirt_stage_first_output_seconds_sum")}
    out = {stage: (n, sums.get(stage, 0.0)) for stage, n in counts.items()}
    api_n, api_s = _summed(lines, "omnirt_audio_ttfp_seconds_count"), _summed(lines, "omnirt_audio_ttfp_seconds_sum")
    if api_n is not None and api_s is not None:
        out["api"] = (api_n, api_s)
    return out


def delta(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """Per stage, counters over a point."""
    return {stage: {k: v - before.get(stage, {}).get(k, 0.0) for k, v in counts.items()}
            for stage, counts in after.items()}


def first_output_ms(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Per stage, the mean milliseconds from submission to its first output over the requests of a point."""
    out = {}
    for stage, (n, total) in after.items():
        n0, total0 = before.get(stage, (0.0, 0.0))
        if n > n0:
            out[stage] = (total - total0) / (n - n0) * 1000
    return out


def first_output_cell(ms: dict[str, float]) -> str:
    """"thinker 35 / talker 80 / code2wav 120" (stages in the server's order)."""
    return " / ".join(f"{stage} {v:.0f}" for stage, v in ms.items()) or "-"


def steps(lines: list[str]) -> dict[str, dict[str, float]]:
    """{stage: {kind + "_steps", kind + "_s" for kind prefill / decode, "rows" (requests stepped), "first_steps",
    "first_wait_steps" (steps a request could have run in before its first)}} of the in-process stages."""
    out: dict[str, dict[str, float]] = {}
    for name, key in (("omnirt_stage_steps_total", "_steps"), ("omnirt_stage_kind_seconds_total", "_s")):
        for tags, value in _labelled(lines, name):
            out.setdefault(tags["stage"], {})[tags["kind"] + key] = value
    for name, key in (("omnirt_stage_batch_size_sum", "rows"), ("omnirt_stage_first_step_wait_steps_count",
                                                                 "first_steps"),
                      ("omnirt_stage_first_step_wait_steps_sum", "first_wait_steps")):
        for tags, value in _labelled(lines, name):
            if tags["stage"] in out:
                out[tags["stage"]][key] = value
    return out


def allocator(lines: list[str]) -> dict[str, float]:
    """The engine process's device allocator counters (empty on the CPU)."""
    return {key: v for key, name in (("alloc_retries", "omnirt_device_alloc_retries_total"),
                                     ("device_allocs", "omnirt_device_allocs_total"))
            if (v := _summed(lines, name)) is not None}


def engine_counters(after: list[str], before: list[str]) -> dict:
    """What the engine did over a point: `steps` per stage and the `allocator`'s counters, as differences."""
    alloc_after, alloc_before = allocator(after), allocator(before)
    return {"steps": delta(steps(after), steps(before)),
            "allocator": {k: v - alloc_before.get(k, 0.0) for k, v in alloc_after.items()}}


def engine_cell(counters: dict) -> str:
    """"thinker: 40 prefill steps x 12.0 ms, 300 decode x 8.1 ms, 9.5 rows a step, 0.4 steps before the first;
    ...; allocator: 0 retries, 2 device allocations" ('-' for none)."""
    parts = []
    for stage, c in counters.get("steps", {}).items():
        if (rows := rows_per_step(counters, stage)) is None:
            continue
        first = c.get("first_wait_steps", 0) / c["first_steps"] if c.get("first_steps") else 0.0
        parts.append(f"{stage}: {c.get('prefill_steps', 0):.0f} prefill steps x {_per_step_ms(c, 'prefill')} ms, "
                     f"{c.get('decode_steps', 0):.0f} decode x {_per_step_ms(c, 'decode')} ms, "
                     f"{rows:.1f} rows a step, {first:.1f} steps waited before the first")
    alloc = counters.get("allocator", {})
    if alloc:
        parts.append(f"allocator: {alloc.get('alloc_retries', 0):.0f} retries, "
                     f"{alloc.get('device_allocs', 0):.0f} device allocations")
    return "; ".join(parts) or "-"


def rows_per_step(counters: dict, stage: str) -> float | None:
    """The requests a step of `stage` held on average over a point (None: it made no step)."""
    c = counters.get("steps", {}).get(stage, {})
    n = c.get("prefill_steps", 0) + c.get("decode_steps", 0)
    return c.get("rows", 0) / n if n else None


def _per_step_ms(counts: dict[str, float], kind: str) -> str:
    n = counts.get(kind + "_steps", 0)
    return f"{counts.get(kind + '_s', 0) / n * 1000:.1f}" if n else "-"


def batch_histogram(lines: list[str]) -> dict[str, dict[float, float]]:
    """{stage: {batch size bound: steps of at most that many rows}} of `omnirt_stage_batch_size`."""
    out: dict[str, dict[float, float]] = {}
    for tags, value in _labelled(lines, "omnirt_stage_batch_size_bucket"):
        out.setdefault(tags["stage"], {})[float(tags["le"])] = value
    return out


def batch_sizes(after: list[str], before: list[str]) -> dict[str, dict[str, float]]:
    """Per stage, rows per step between two scrapes, from the engine's own counters: {"steps", "mean", "p90"} (p90:
    the least size that at least 90% of the steps did not exceed). Stages that made no step are left out."""
    hist0, out = batch_histogram(before), {}
    for stage, buckets in batch_histogram(after).items():
        counts = {le: n - hist0.get(stage, {}).get(le, 0.0) for le, n in sorted(buckets.items())}
        steps = counts.pop(float("inf"), 0.0)
        if steps <= 0:
            continue
        below, rows = 0.0, 0.0  # the cumulative counts per bound, back to steps per size
        for size, n in counts.items():
            rows, below = rows + size * (n - below), n
        p90 = next((size for size, n in counts.items() if n >= 0.9 * steps), max(counts, default=0.0))
        out[stage] = {"steps": steps, "mean": rows / steps, "p90": p90}
    return out


def batch_cell(sizes: dict[str, dict[str, float]]) -> str:
    """"thinker 3.2 / 5, talker 4.0 / 6, ..." (mean / p90 rows a step)."""
    return ", ".join(f"{stage} {s['mean']:.1f} / {s['p90']:.0f}" for stage, s in sizes.items()) or "-"
