"""`omnirt bench` (chat) measures a steady state: each worker a closed loop through a warm-up and a window of at least
its length and of `--min-requests` requests a worker, warm-up excluded; prompts distinct, of lengths within the
stated range and drawn again by their seed; the Thinker sampled as stated; the older shapes (`--wave`,
`--repeat-prompt`, greedy) labelled diagnostic in the rows, the table and the plot's title."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess

import pytest

from omnirt.loadtest import bench
from omnirt.loadtest.chat_requests import Prompts, parse_lengths, request_body, sentences
from omnirt.loadtest.closed_loop import steady, wave
from tests.conftest import OMNIRT, ROOT


def _sender(lo_s: float, hi_s: float, seed: int = 0):
    """A request of a random duration, and how many ran at once at most."""
    rng, running, peak = random.Random(seed), [0], [0]

    async def send():
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(rng.uniform(lo_s, hi_s))
        running[0] -= 1
        return "sample"

    return send, peak


async def test_each_worker_is_a_closed_loop_and_the_window_excludes_the_warm_up():
    send, peak = _sender(0.02, 0.08)
    w = await steady(send, concurrency=4, warmup_s=0.3, window_s=0.5, min_requests=3)
    assert peak[0] == 4 and w.length_s >= 0.5 and min(w.per_worker()) >= 3
    for i in range(4):  # a worker's next request leaves only when its last one has ended
        mine = sorted((r for r in w.records if r.worker == i), key=lambda r: r.start_s)
        assert all(b.start_s >= a.end_s for a, b in zip(mine, mine[1:])) and mine[0].start_s < 0.3
    warm = [r for r in w.records if r.start_s < w.start_s]
    assert warm and not set(map(id, warm)) & set(map(id, w.measured()))  # the warm-up's requests are not measured
    across = [r for r in warm if r.end_s >= w.start_s]  # in flight as the window opened: their completions count
    assert len(w.completed()) == len(w.measured()) + len(across)
    assert all(w.start_s <= r.start_s and r.end_s <= w.end_s for r in w.measured())


async def test_the_window_goes_on_until_every_worker_has_its_requests():
    send, _ = _sender(0.04, 0.06)
    w = await steady(send, concurrency=3, warmup_s=0.0, window_s=0.05, min_requests=6)
    assert min(w.per_worker()) >= 6 and w.length_s >= 6 * 0.04


async def test_a_worker_that_fails_ends_the_point_with_its_error():
    async def send():
        await asyncio.sleep(0.01)
        raise RuntimeError("the client broke")

    with pytest.raises(RuntimeError, match="the client broke"):
        await asyncio.wait_for(steady(send, concurrency=2, warmup_s=0.0, window_s=0.05, min_requests=2), 60)


async def test_a_wave_sends_its_requests_over_its_workers_and_ends():
    send, peak = _sender(0.01, 0.03)
    w = await wave(send, concurrency=3, num_requests=7)
    assert len(w.records) == len(w.measured()) == 7 and peak[0] == 3 and sum(w.per_worker()) == 7


def test_prompts_are_distinct_within_their_range_and_drawn_again_by_their_seed():
    lengths = parse_lengths("16-640")
    draws = [Prompts(7, lambda t: t) for _ in range(2)]
    texts = [[p.next(lengths) for _ in range(300)] for p in draws]
    assert texts[0] == texts[1] and len(set(texts[0])) == 300
    assert texts[0] != [Prompts(8, lambda t: t).next(lengths) for _ in range(300)]
    drawn = Prompts(3, lambda t: t)
    sizes = [drawn.length(lengths) for _ in range(2000)]
    assert 16 <= min(sizes) and max(sizes) <= 640
    short, long = sum(s < 101 for s in sizes), sum(s >= 101 for s in sizes)  # 101: the geometric middle
    assert 0.4 < short / len(sizes) < 0.6 and long  # log-uniform: as many below the middle as above it
    assert {len(drawn.next((40, 40)).split()) for _ in range(20)} == {40}  # the calibrated word count, exactly
    tiny = Prompts(2, lambda t: 1)  # one-word prompts run out: the next ones grow by a word, still distinct
    assert len({tiny.next((5, 5)) for _ in range(400)}) == 400
    assert sentences(random.Random(0), 25).count(".") >= 3


def test_the_thinker_is_sampled_as_stated_and_greedy_only_when_asked():
    args = bench.build_parser().parse_args([])
    body = request_body(args, "Hello there.")
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.8, 20)
    assert body["min_tokens"] == body["max_tokens"] == 40 and body["messages"][0]["content"] == "Hello there."
    greedy = request_body(bench.build_parser().parse_args(["--greedy"]), "Hi.")
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy and "top_k" not in greedy
    assert bench.labels(args)["diagnostic"] == []


def test_the_older_shapes_are_labelled_diagnostic_everywhere():
    args = bench.build_parser().parse_args(["--wave", "--repeat-prompt", "--greedy"])
    shape = bench.labels(args)
    assert shape["diagnostic"] == ["wave", "repeated prompt", "greedy"]
    assert all(shape[k].endswith("(diagnostic)") for k in ("load", "prompts", "sampling"))
    row = {"prompt_len": "160", "concurrency": 2, "ok": 2, **shape}
    table = bench.markdown([row], "t")
    assert "**Diagnostic** (greedy, repeated prompt, wave)" in table
    assert "| repeated (diagnostic) | 2 | wave (diagnostic) | greedy (diagnostic) |" in table
    steady_table = bench.markdown([{**row, **bench.labels(bench.build_parser().parse_args([]))}], "t")
    assert "diagnostic" not in steady_table.lower()


@pytest.mark.parametrize("flag", ["--rounds", "--requests-per-point", "--warmup"])
def test_a_wave_flag_without_wave_is_refused(flag):
    args = bench.build_parser().parse_args([flag, "1", "--url", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit, match=f"{flag}: only with --wave"):
        bench.plan(args)


def test_a_steady_run_against_the_server(server, tmp_path):
    """A short steady run: every worker completed its requests inside the window, each stage's rows a step are
    there, the prompts sent were of different lengths, nothing labelled diagnostic."""
    run = subprocess.run([*OMNIRT, "bench", "--url", server.url, "--prompt-lens", "16-200", "--concurrency", "2",
                          "--warmup-s", "0.5", "--window-s", "1", "--min-requests", "2", "--seed", "5",
                          "--thinker-tokens", "4", "--talker-frames", "6", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "seed 5; sampling T 0.7, top-p 0.8, top-k 20" in run.stdout
    [row] = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert row["load"] == "steady" and row["diagnostic"] == [] and row["seed"] == 5
    assert row["per_worker_min"] >= 2 and row["ok"] >= 4 and row["failed"] == 0 and row["window_s"] >= 1
    assert row["req_per_s"] > 0 and row["ttfp_p50_ms"] > 0 and row["underruns"] >= 0
    sizes = row["rows_per_step"]
    assert all(1 <= sizes[s]["mean"] <= sizes[s]["p90"] + 1e-9 for s in ("thinker", "talker", "code2wav")), sizes
    assert row["prompt_tokens"]["min"] < row["prompt_tokens"]["max"]
    assert "Prompts drawn with seed 5" in (tmp_path / "bench.md").read_text()
