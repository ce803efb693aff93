"""What the soaks share: the server's RSS sampled through the run, and the plateau check on it.

The first third of a run is its warm-up (the allocator and caches grow to the working set); the median
RSS over the last third may be at most `max_growth_mb` above the median over the middle third (single
samples swing by ~100 MB); a leak of 1 MB per request or session shows as hundreds of MB."""

from __future__ import annotations

import json
import os
import statistics
import threading

import psutil

from tests.conftest import ARTIFACTS

MAX_GROWTH_MB = float(os.environ.get("OMNIRT_SOAK_MAX_GROWTH_MB", "150"))
# The plateau is a figure of `make soak` (minutes, enough samples); the short CI run reports it but
# asserts only counts and invariants: a loaded 2-core machine can make 30 s of RSS samples say anything.
CHECK_PLATEAU = os.environ.get("OMNIRT_SOAK_CHECK_RSS") == "1"


def check_plateau(summary: dict) -> None:
    if CHECK_PLATEAU:
        assert summary["rss_trend_mb"] < MAX_GROWTH_MB, summary


class RssSampler:
    """Samples a process's RSS (MB) every `every_s` on a thread, between `with` entry and exit."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.proc, self.every_s = psutil.Process(pid), every_s
        self.samples: list[float] = []
        self.start_mb = self.end_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_mb(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def __enter__(self) -> RssSampler:
        self.start_mb = self.rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end_mb = self.rss_mb()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(self.rss_mb())

    def summary(self) -> dict:
        rss = self.samples or [self.end_mb]
        third = max(1, len(rss) // 3)
        return {"rss_start_mb": round(self.start_mb, 1), "rss_end_mb": round(self.end_mb, 1),
                "rss_growth_mb": round(self.end_mb - self.start_mb, 1), "rss_peak_mb": round(max(rss), 1),
                "rss_trend_mb": round(statistics.median(rss[-third:]) - statistics.median(rss[third:-third] or rss),
                                      1),
                "rss_per_10pct": [round(rss[int(i * (len(rss) - 1) / 10)], 1) for i in range(11)]}


def report(name: str, summary: dict) -> None:
    """Print the figures and keep them in tests/artifacts/<name>.json."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(f"{name}: {summary}")
