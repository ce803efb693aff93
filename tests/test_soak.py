"""Soak: N concurrent streaming audio requests for a bounded time against a real server. Every response
must arrive whole (PCM length == every codec frame of its usage, then [DONE]); all slots are free at the
end. CI runs 8 clients for 30 s; `make soak` runs 64 for 600 s (OMNIRT_SOAK_N, OMNIRT_SOAK_S) and also
checks that the server's memory plateaus (tests/soak_helpers.py: the last third's median RSS at most
MAX_GROWTH_MB above the middle third's; CI only reports it)."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import ServerProcess
from tests.soak_helpers import RssSampler, check_plateau, report
from tests.sse_client import audio_body, stream_chat

NUM_CLIENTS = int(os.environ.get("OMNIRT_SOAK_N", "8"))
DURATION_S = float(os.environ.get("OMNIRT_SOAK_S", "30"))


def _client(url: str, i: int, until: float) -> list:
    results, n = [], 0
    while time.monotonic() < until:
        results.append(stream_chat(url, audio_body(max_tokens=8 + (i + n) % 9, frames=20 + 7 * ((i + n) % 7)),
                                   timeout=300))
        n += 1
    return results


def test_soak_streaming_audio():
    srv = ServerProcess([])
    try:
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:  # warm-up: allocator and caches reach their working size
            list(pool.map(lambda i: stream_chat(srv.url, audio_body(16, 60)), range(NUM_CLIENTS)))
        started = time.monotonic()
        with RssSampler(srv.proc.pid) as rss, ThreadPoolExecutor(NUM_CLIENTS) as pool:
            results = [r for rs in pool.map(lambda i: _client(srv.url, i, started + DURATION_S), range(NUM_CLIENTS))
                       for r in rs]
        elapsed = time.monotonic() - started
        h = srv.wait_idle()
        incomplete = [r for r in results if not r.is_complete]
        ttfp = sorted(r.ttfp_s for r in results if r.ttfp_s is not None)
        summary = {"clients": NUM_CLIENTS, "duration_s": round(elapsed, 1), "requests": len(results),
                   "incomplete": len(incomplete), "audio_packets": sum(r.num_packets for r in results),
                   "audio_s": round(sum(len(r.pcm) for r in results) / 48000, 1),
                   "ttfp_p50_s": round(statistics.median(ttfp), 3), "ttfp_p95_s": round(ttfp[int(0.95 * len(ttfp))], 3),
                   **rss.summary(), "slots_free_at_end": h["free_slots"] == h["slots"]}
        report(f"soak-{NUM_CLIENTS}x{int(DURATION_S)}s", summary)
        assert results and not incomplete, [(r.status, r.error, r.done, r.audio_frames) for r in incomplete[:5]]
        check_plateau(summary)
        assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
    finally:
        srv.stop()
