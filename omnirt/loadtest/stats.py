"""Percentiles as every report prints them: nearest rank, and a tail quantile only where the sample can tell
it from its maximum. Of n values, the q-quantile for q above the median needs n >= 1 / (1 - q) (p90: 10
values, p99: 100): with fewer, the highest rank it would pick is the maximum itself, so the report gives
the maximum and says so rather than print it under a percentile's name."""

from __future__ import annotations

import math
from collections.abc import Iterable

QUANTILES = (50, 90, 99)


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The nearest-rank q-th percentile (q in percent), or None when too few values for it (or none)."""
    xs = sorted(v for v in values if v is not None)
    if not xs or (q > 50 and len(xs) * (100 - q) < 100):
        return None
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def summary(values: Iterable[float | None], quantiles: tuple[int, ...] = QUANTILES) -> dict:
    """{"p50": .., "p90": .., "p99": .., "max": .., "n": ..}; a quantile the sample is too small for is None."""
    xs = [v for v in values if v is not None]
    return {**{f"p{q}": percentile(xs, q) for q in quantiles}, "max": max(xs, default=None), "n": len(xs)}


def cell(s: dict, keys: tuple[str, ...] = ("p50", "p90", "p99"), fmt: str = "{:.0f}") -> str:
    """"p50 / p90 / p99" for a table; a quantile the sample is too small for is shown as "max X"."""
    if not s.get("n"):
        return "-"
    return " / ".join(fmt.format(s[k]) if s.get(k) is not None else "max " + fmt.format(s["max"]) for k in keys)


NOTE = ("Percentiles are nearest-rank over the point's samples; a p90 needs 10 of them and a p99 100: with fewer, "
        "the cell gives the maximum, as \"max X\".")
