"""The Locust suite itself, briefly, against the session server: one chat user and one Realtime user
(a WebSocket session, spoken turns paced in real time, server VAD, a barge-in share) run without a
failure, and their custom metrics arrive through Locust's request events and, unrounded, in the raw
samples."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_locust_headless_short_run(server, tmp_path):
    prefix = tmp_path / "lt"
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--host", server.url, "-u", "2", "-r", "2", "-t", "12s", "--stop-timeout", "30", "--csv", str(prefix),
         "--raw-samples", str(prefix), "--only-summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMNIRT_LOADTEST_MAX_TOKENS": "8"})
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "skipping RealtimeUser" not in out, out[-3000:]
    summary = json.loads((tmp_path / "lt_summary.json").read_text())
    assert not {k: v for k, v in summary.items() if v["failures"]}, summary
    chat = summary["POST POST /v1/chat/completions (stream, audio)"]
    assert chat["count"] >= 2
    for name in ("chat time_to_first_audio", "chat end_to_end", "chat audio_gap", "chat rtf_x1000",
                 "realtime turn_latency", "realtime first_audio_after_speech_stopped", "realtime audio_gap"):
        assert summary[f"audio {name}"]["count"] >= 1, name
    assert summary["realtime connect"]["count"] == 1 and summary["realtime turn"]["count"] >= 1, summary
    assert 0 < summary["realtime connect"]["p50"] < 10_000 and summary["audio realtime turn_latency"]["p50"] > 0
    rows = list(csv.DictReader((tmp_path / "lt_samples.csv").open()))
    stats = {r["Name"]: r for r in csv.DictReader((tmp_path / "lt_stats.csv").open())}
    for name in ("chat time_to_first_audio", "realtime turn_latency"):
        raw = [float(r["value_ms"]) for r in rows if r["name"] == name]
        assert raw and any(v != round(v, -1) for v in raw), name  # raw, not Locust's rounded values
        assert 1 <= int(stats[name]["Request Count"]) <= len(raw), name  # raw also keeps the stop phase
