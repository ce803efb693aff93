"""`omnirt bench realtime --mode converse` (the headline) against the tiny model: sessions play each reply to its end
before they think and speak again, start out of step, leave their warm-up turns out, and the report shows the engine's
rows a step and whether replies were pinned; the capacity search's logic with a fake point, and once for real."""

from __future__ import annotations

import json
import subprocess

import pytest

from omnirt.loadtest import capacity
from tests.conftest import OMNIRT, ROOT

SHORT = ["--max-utterance-s", "2", "--think-s", "0.5", "1", "--clients", "2"]  # the set's short utterances


def _bench(url: str, out, name: str, *more: str) -> tuple[dict, str]:
    run = subprocess.run([*OMNIRT, "bench", "realtime", "--url", url, "--name", name, "--out", str(out), *SHORT,
                          *more], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = json.loads((out / f"{name}.json").read_text())
    return report["results"], (out / f"{name}.md").read_text()


def test_converse_plays_replies_out_of_step_and_reports_rows_a_step(server, tmp_path):
    """3 sessions x (1 warm-up + 2 measured turns), replies pinned at 6 frames: each next utterance starts after the
    reply played to its end plus the think time; the first turns start spread over --spread-s; only measured turns
    count; rows a step come from the engine's counters."""
    (row,), md = _bench(server.url, tmp_path, "cv", "--sessions", "3", "--turns", "2", "--reply-frames", "6",
                        "--reply-tokens", "8", "--spread-s", "3")
    assert row["mode"] == "converse" and row["errors"] == 0, row["error_samples"]
    assert row["turns"] == row["expected_turns"] == 6 and row["turns_without_audio"] == 0
    assert row["underruns"] is not None and row["reply_audio_s"]["n"] == 6
    assert [t["turn"] for t in row["by_turn"]] == [2, 3]  # the warm-up turn (1) is left out
    log = row["turn_log"]
    assert len(log) == 9 and all(t["played_until"] is not None for t in log)
    for before, after in zip(log, log[1:]):
        if before["session"] == after["session"]:  # spoke again only once the reply played, and after thinking
            assert before["played_until"] >= before["first_audio"] + before["audio_s"] - 0.05, before
            assert after["speech_start"] >= before["played_until"] + before["think_s"], (before, after)
            assert 0.5 <= before["think_s"] <= 1.0
    firsts = {t["session"]: t["speech_start"] for t in log if t["index"] == 0}
    for i in (1, 2):  # out of step from the first turn: 3 s spread over 3 sessions
        assert firsts[i] - firsts[0] >= i * 1.0 - 0.05, firsts
    steps = row["rows_per_step"]
    assert set(steps) >= {"thinker", "talker", "code2wav"} and all(s["mean"] >= 1 and s["p90"] >= 1
                                                                    for s in steps.values()), steps
    assert "replies pinned at 6 frames" in md and "rows a step per stage (mean / p90): thinker " in md


def test_an_unpinned_reply_plays_to_its_end(server, tmp_path):
    """Without --reply-frames the reply is the model's own length (the tiny model's ends at the profile's limit), and
    the session waits for all of it to play before it speaks again."""
    (row,), md = _bench(server.url, tmp_path, "free", "--sessions", "1", "--turns", "2", "--warmup-turns", "0")
    assert row["errors"] == 0 and row["turns"] == 2 and row["turns_without_audio"] == 0, row
    first, second = row["turn_log"]
    assert first["audio_s"] > 6 * 0.08  # longer than any pinned reply of the tests
    assert first["played_until"] >= first["first_audio"] + first["audio_s"] - 0.05
    assert second["speech_start"] >= first["played_until"] + first["think_s"]
    assert "replies unpinned" in md


def test_diagnostic_modes_are_labelled(server, tmp_path):
    (row,), md = _bench(server.url, tmp_path, "diag", "--sessions", "1", "--turns", "1", "--mode", "cancel")
    assert row["errors"] == 0 and row["turns"] == 1 and "| cancel (diagnostic) |" in md


def _row(n: int, p90: float, underruns: int = 0, lost: int = 0) -> dict:
    return {"sessions": n, "response_ms": {"p90": p90, "max": p90}, "underruns": underruns,
            "turns_without_audio": lost, "turns": 5 * n, "expected_turns": 5 * n, "errors": 0}


@pytest.mark.parametrize(("knee", "start", "limit", "expected", "tried"), [
    (37, 1, 512, 37, [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]),
    (100, 1, 64, 64, [1, 2, 4, 8, 16, 32, 64]),
    (0, 1, 64, 0, [1]),
    (5, 4, 64, 5, [4, 8, 6, 5]),
])
def test_capacity_doubles_then_bisects_to_the_last_passing_count(knee, start, limit, expected, tried):
    """A point passes up to `knee` sessions (latency within the bound), fails past it."""
    rows, last = capacity.search(lambda n: _row(n, 500 if n <= knee else 900), start, limit, 800)
    assert last == expected and [r["sessions"] for r in rows] == tried
    assert all(r["passed"] == (r["sessions"] <= knee) for r in rows)


def test_an_underrun_or_a_lost_turn_fails_a_point_within_the_bound():
    assert capacity.failures(_row(4, 100), 800) == []
    assert capacity.failures(_row(4, 100, underruns=1), 800) == ["1 underruns"]
    assert capacity.failures(_row(4, 100, lost=2), 800) == ["2 lost turns"]
    assert capacity.failures({**_row(4, 100), "turns": 19}, 800) == ["1 lost turns"]
    assert capacity.failures({**_row(1, None), "response_ms": {"p90": None, "max": 900.0}}, 800)  # few: the max


def test_capacity_search_against_the_tiny_model(server, tmp_path):
    """--capacity with a bound every point meets: 1, then 2 sessions pass, and the report names 2 the capacity."""
    rows, md = _bench(server.url, tmp_path, "cap", "--capacity", "--sessions", "1", "--max-sessions", "2",
                      "--turns", "1", "--warmup-turns", "0", "--reply-frames", "4", "--latency-bound", "60000")
    assert [(r["sessions"], r["passed"]) for r in rows] == [(1, True), (2, True)], rows
    assert "### capacity: 2 sessions" in md
