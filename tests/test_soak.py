"""Soak: N concurrent streaming audio requests for a bounded time against a real server. Every response
must arrive whole (PCM length == every codec frame of its usage, then [DONE]); the server's memory may
plateau: the first third of the run is its warm-up (the allocator and caches grow to the working set), and the
median RSS over the last third may be at most MAX_GROWTH_MB above the median over the middle third (single
samples swing by ~100 MB); a leak of 1 MB per request shows as hundreds of MB. All slots are free at the end.
CI runs 8 clients for 30 s; `make soak` runs 64 for 600 s (OMNIRT_SOAK_N, OMNIRT_SOAK_S)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from tests.conftest import ARTIFACTS, ServerProcess
from tests.sse_client import audio_body, stream_chat

NUM_CLIENTS = int(os.environ.get("OMNIRT_SOAK_N", "8"))
DURATION_S = float(os.environ.get("OMNIRT_SOAK_S", "30"))
MAX_GROWTH_MB = float(os.environ.get("OMNIRT_SOAK_MAX_GROWTH_MB", "150"))


def _client(url: str, i: int, until: float) -> list:
    results, n = [], 0
    while time.monotonic() < until:
        results.append(stream_chat(url, audio_body(max_tokens=8 + (i + n) % 9, frames=20 + 7 * ((i + n) % 7)),
                                   timeout=300))
        n += 1
    return results


def _sample_rss(proc: psutil.Process, out: list[float], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        out.append(proc.memory_info().rss / 2**20)


def test_soak_streaming_audio():
    srv = ServerProcess([])
    try:
        proc = psutil.Process(srv.proc.pid)
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:  # warm-up: allocator and caches reach their working size
            list(pool.map(lambda i: stream_chat(srv.url, audio_body(16, 60)), range(NUM_CLIENTS)))
        rss_start = proc.memory_info().rss / 2**20
        started, rss, stop = time.monotonic(), [], threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(proc, rss, stop))
        sampler.start()
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            results = [r for rs in pool.map(lambda i: _client(srv.url, i, started + DURATION_S), range(NUM_CLIENTS))
                       for r in rs]
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
        rss_end = proc.memory_info().rss / 2**20
        h = srv.wait_idle(timeout=60)
        incomplete = [r for r in results if not r.is_complete]
        ttfp = sorted(r.ttfp_s for r in results if r.ttfp_s is not None)
        third = max(1, len(rss) // 3)
        summary = {"clients": NUM_CLIENTS, "duration_s": round(elapsed, 1), "requests": len(results),
                   "incomplete": len(incomplete), "audio_packets": sum(r.num_packets for r in results),
                   "audio_s": round(sum(len(r.pcm) for r in results) / 48000, 1),
                   "ttfp_p50_s": round(statistics.median(ttfp), 3), "ttfp_p95_s": round(ttfp[int(0.95 * len(ttfp))], 3),
                   "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
                   "rss_growth_mb": round(rss_end - rss_start, 1), "rss_peak_mb": round(max(rss), 1),
                   "rss_trend_mb": round(statistics.median(rss[-third:]) - statistics.median(rss[third:-third]), 1),
                   "rss_per_10pct": [round(rss[int(i * (len(rss) - 1) / 10)], 1) for i in range(11)],
                   "slots_free_at_end": h["free_slots"] == h["slots"]}
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / f"soak-{NUM_CLIENTS}x{int(DURATION_S)}s.json").write_text(json.dumps(summary, indent=1))
        print(f"soak: {summary}")
        assert results and not incomplete, [(r.status, r.error, r.done, r.audio_frames) for r in incomplete[:5]]
        assert summary["rss_trend_mb"] < MAX_GROWTH_MB, summary
        assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
    finally:
        srv.stop()
