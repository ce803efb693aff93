"""The benchmarks' percentiles (`omnirt/loadtest/stats.py`): nearest rank, and a tail percentile only where the
sample has enough values for it; every report (chat bench, Realtime bench, Locust's raw summary) prints the
maximum, labelled "max", in its place rather than a maximum under a percentile's name."""

from __future__ import annotations

import pytest

from omnirt.loadtest.bench import markdown, summarize
from omnirt.loadtest.chat_requests import Sample
from omnirt.loadtest.closed_loop import Timed, Window
from omnirt.loadtest.realtime_report import markdown as realtime_markdown
from omnirt.loadtest.realtime_report import summarize as realtime_summarize
from omnirt.loadtest.stats import cell, percentile, summary


@pytest.mark.parametrize("n,q,expected", [(100, 99, 99), (101, 99, 100), (200, 99, 198), (99, 99, None),
                                          (10, 90, 9), (9, 90, None), (1, 50, 1), (3, 50, 2), (0, 50, None)])
def test_nearest_rank_and_none_where_too_few(n, q, expected):
    assert percentile(range(1, n + 1), q) == expected


def test_a_small_sample_shows_its_maximum_as_such():
    s = summary([30.0, 10.0, 20.0])
    assert s == {"p50": 20.0, "p90": None, "p99": None, "max": 30.0, "n": 3}
    assert cell(s) == "20 / max 30 / max 30" and cell(summary([])) == "-"
    assert cell(summary(range(1, 201))) == "100 / 180 / 198"


def _samples(n: int) -> list[Sample]:
    return [Sample(ok=True, ttft_s=0.01, ttfp_s=(i + 1) / 1000, audio_s=1.0, rtf=0.5, gaps_s=[0.1, 0.2])
            for i in range(n)]


def _point(n: int, c: int) -> dict:
    window = Window([Timed(i % c, 0.0, 1.0, s) for i, s in enumerate(_samples(n))], 0.0, 1.0, concurrency=c)
    return summarize(window, {"prompt_len": "10", "concurrency": c})


def test_chat_bench_rows_label_a_p99_of_few_requests_as_the_maximum():
    few, many = _point(8, 1), _point(150, 16)
    assert (few["ttfp_p99_ms"], few["ttfp_max_ms"], few["num_gaps"]) == (None, 8.0, 16)
    assert (many["ttfp_p99_ms"], many["gap_p99_ms"], many["num_gaps"]) == (149.0, 200.0, 300)
    table = markdown([few, many], "t").splitlines()
    assert "| max 8 |" in table[4] and "| max 200 |" in table[4] and "| 149 |" in table[5]
    assert "max X" in table[-1]


def test_realtime_rows_label_percentiles_of_few_turns_as_the_maximum():
    turns = [{"index": 0, "vad_lag_ms": 100.0 + i, "response_ms": 500.0 + i, "voice_to_voice_ms": 1000.0 + i,
              "first_audio": 1.0, "speech_stopped": 1.0, "underruns": 0, "input_tokens": 10, "cached_tokens": 0,
              "transcript_ms": None, "transcript_failed": False, "turn_end_ms": 600.0 + i, "cut_ins": i // 2}
             for i in range(3)]
    args = type("Args", (), {"mode": "cancel", "turns": 3, "transcribe": False, "turn_detection": "semantic_vad",
                             "eagerness": "high", "noise_reduction": "far_field", "speech": "paused"})()
    row = {**realtime_summarize(1, turns, [], args, None, 0.1), "abusive": 0, "abuse": {}}
    text = realtime_markdown([row], "t")
    assert "| semantic_vad (high), far_field, paused speech |" in text
    assert ("| 101 / max 102 / max 102 | 601 / max 602 / max 602 | 1 (1) | 501 / max 502 / max 502 | 1001 / max 1002 "
            "/ max 1002 |") in text
    assert "| turn 1 | 1 | 501 / max 502 | 1001 |" in text
