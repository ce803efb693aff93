"""What the benchmarks read from the server's /metrics around a point: the API process's CPU seconds, the
prompt tokens each stage computed or reused, and when each stage first served a request."""

from __future__ import annotations

import time

import httpx

STATS_PERIOD_S = 0.2  # the engine core sends the API process a stats snapshot this often (pipeline/core.py)


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
