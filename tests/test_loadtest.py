"""The Locust suite itself, briefly, against the session server: chat users stream audio without a
failure, the custom audio metrics arrive through Locust's request events and in the raw samples, and
the Realtime user is skipped with a clear message when the server has no /v1/realtime."""

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
    assert run.returncode == 0, out[-3000:]
    if "skipping RealtimeUser" not in out:  # a server with /v1/realtime: realtime turns must have run
        assert "realtime turn" in out
    summary = json.loads((tmp_path / "lt_summary.json").read_text())
    chat = summary["POST POST /v1/chat/completions (stream, audio)"]
    assert chat["count"] >= 2 and chat["failures"] == 0
    for name in ("time_to_first_audio", "end_to_end", "audio_gap", "rtf_x1000"):
        assert summary[f"audio chat {name}"]["count"] >= 1, name
    rows = list(csv.DictReader((tmp_path / "lt_samples.csv").open()))
    ttfa = [float(r["value_ms"]) for r in rows if r["name"] == "chat time_to_first_audio"]
    assert ttfa and any(v != round(v, -1) for v in ttfa)  # raw, not Locust's rounded values
    stats = {r["Name"]: r for r in csv.DictReader((tmp_path / "lt_stats.csv").open())}
    assert 1 <= int(stats["chat time_to_first_audio"]["Request Count"]) <= len(ttfa)  # raw also keeps the stop phase
