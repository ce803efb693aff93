"""The Locust suite itself, briefly, against the session server: one chat user and one Realtime user
(a WebSocket session, spoken turns paced in real time, server VAD, a barge-in share) run without a
failure, and their custom metrics arrive through Locust's request events and, unrounded, in the raw
samples."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import OMNIRT, ROOT, ServerProcess


def test_locust_headless_short_run(server, tmp_path):
    """Counts that hold however slow the machine: the stop phase (`--stop-timeout`, a hang guard) lets each
    user finish the task it is in, so the first chat request and the first turn always complete."""
    prefix = tmp_path / "lt"
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "omnirt" / "loadtest" / "locustfile.py"), "--headless",
         "--host", server.url, "-u", "2", "-r", "2", "-t", "20s", "--stop-timeout", "180", "--csv", str(prefix),
         "--raw-samples", str(prefix), "--only-summary"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMNIRT_LOADTEST_MAX_TOKENS": "8"})
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "skipping RealtimeUser" not in out, out[-3000:]
    summary = json.loads((tmp_path / "lt_summary.json").read_text())
    assert not {k: v for k, v in summary.items() if v["failures"]}, summary
    chat = summary["POST POST /v1/chat/completions (stream, audio)"]
    assert chat["count"] >= 1
    for name in ("chat time_to_first_audio", "chat end_to_end", "chat audio_gap", "chat rtf_x1000",
                 "realtime turn_latency", "realtime first_audio_after_speech_stopped", "realtime audio_gap"):
        assert summary[f"audio {name}"]["count"] >= 1, name
    assert summary["realtime connect"]["count"] == 1 and summary["realtime turn"]["count"] >= 1, summary
    assert summary["realtime connect"]["p50"] > 0 and summary["audio realtime turn_latency"]["p50"] > 0
    rows = list(csv.DictReader((tmp_path / "lt_samples.csv").open()))
    stats = {r["Name"]: r for r in csv.DictReader((tmp_path / "lt_stats.csv").open())}
    for name in ("chat time_to_first_audio", "realtime turn_latency"):
        raw = [float(r["value_ms"]) for r in rows if r["name"] == name]
        assert raw and any(v != round(v, -1) for v in raw), name  # raw, not Locust's rounded values
        assert 1 <= int(stats[name]["Request Count"]) <= len(raw), name  # raw also keeps the stop phase


def test_bench_picks_a_sweep_that_fits_the_server_and_says_so(server, tmp_path):
    """Against the CPU server, without a sweep given: the small CPU sweep, announced (--dry-run: only that)."""
    for cmd, plan in ((["bench"], "prompt lengths 16-160 tokens x concurrency 1 2 4"),
                      (["bench", "realtime"], "[1, 4] websocket sessions x (1 + 5) turns, mode converse")):
        run = subprocess.run([*OMNIRT, *cmd, "--url", server.url, "--dry-run"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 0 and run.stdout.startswith(f"would run: cpu server at {server.url}: {plan}"), run
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_bench_writes_into_an_untracked_run_folder_by_default(server, tmp_path):
    run = subprocess.run([*OMNIRT, "bench", "--url", server.url, "--prompt-lens", "10",
                          "--concurrency", "1", "--wave", "--requests-per-point", "2", "--rounds", "1", "--warmup", "1",
                          "--thinker-tokens", "4", "--talker-frames", "6"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [folder] = (tmp_path / "bench-results").iterdir()
    assert folder.name.startswith("bench-") and {f.name for f in folder.iterdir()} == {"bench.json", "bench.md",
                                                                                     "bench.png"}
    row = json.loads((folder / "bench.json").read_text())["results"][0]
    assert (row["prompt_len"], row["concurrency"], row["ok"], row["failed"]) == ("10", 1, 2, 0), row
    firsts = row["first_output_ms"]  # from the server's /metrics (tests/test_first_packet.py checks their order)
    assert list(firsts) == ["thinker", "talker", "code2wav", "api"] and all(v > 0 for v in firsts.values()), firsts
    steps = row["engine"]["steps"]  # the point's steps: each request took a prefill and decode steps in each stage
    assert set(steps) == {"thinker", "talker", "code2wav"} and steps["thinker"]["prefill_steps"] >= 1, steps
    assert steps["thinker"]["decode_steps"] >= 2 and steps["thinker"]["rows"] >= steps["thinker"]["decode_steps"]
    assert row["engine"]["allocator"] == {}  # the CPU has no device allocator
    assert "engine steps over the window: thinker: " in (folder / "bench.md").read_text()
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench-results/bench-x/bench.json"], cwd=ROOT)
    assert ignored.returncode == 0  # in a checkout, that folder is one git ignores


def test_think_times_are_each_session_s_own_and_the_same_every_run():
    """--think-s: a session's pauses before it speaks again vary within the bounds, differ between sessions and come
    the same in every run (seeded by the session)."""
    from omnirt.loadtest.realtime_bench import build_parser
    from omnirt.loadtest.realtime_mic import Mic

    args = build_parser().parse_args(["--think-s", "0.5", "3"])
    runs = [[Mic(i, args, None) for i in range(3)] for _ in range(2)]
    series = [[[m.think() for _ in range(20)] for m in run] for run in runs]
    assert series[0] == series[1] and series[0][0] != series[0][1]
    assert all(0.5 <= g <= 3.0 for s in series[0] for g in s) and max(series[0][0]) - min(series[0][0]) > 1.0


@pytest.mark.parametrize(("mode", "transport"), [("cancel", "websocket"), ("no-responses", "websocket"),
                                               ("cancel", "webrtc"), ("converse", "websocket")])
def test_bench_realtime_short_run(server, tmp_path, mode, transport):
    """`omnirt bench realtime`: 2 spoken sessions x (1 warm-up + 1 measured turn) over 2 client processes,
    over the WebSocket or as WebRTC calls; every turn is detected (and, with responses, answered with
    audio), nothing fails, only measured turns count, and the report has its figures. Replies played whole
    (converse) are capped (`--reply-frames`): none is longer than its frames' audio."""
    run = subprocess.run([*OMNIRT, "bench", "realtime", "--url", server.url, "--sessions", "2",
                          "--turns", "1", "--clients", "2", "--mode", mode, "--transport", transport, "--name", "rt",
                          "--out", str(tmp_path), *(["--reply-frames", "6", "--reply-tokens", "8"] if mode == "converse"
                                                    else [])],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    row = json.loads((tmp_path / "rt.json").read_text())["results"][0]
    assert row["turns"] == row["expected_turns"] == 2 and row["errors"] == 0, row["error_samples"]
    assert row["turns_without_speech_stopped"] == 0 and row["vad_lag_ms"]["n"] == 2
    if mode == "cancel":
        assert row["turns_without_audio"] == 0 and row["response_ms"]["n"] == row["voice_to_voice_ms"]["n"] == 2
        (turn,) = row["by_turn"]  # the second turn of each conversation: its start was the first turn's
        assert turn["turn"] == 2 and turn["input_tokens"] > turn["cached_tokens"] > 0, turn
        assert row["prefill_tokens"]["thinker"]["cached"] > 0 and row["prefill_tokens"]["thinker"]["computed"] > 0
        assert set(row["first_output_ms"]) == {"thinker", "talker", "code2wav", "api"}, row["first_output_ms"]
        assert row["engine"]["steps"]["thinker"]["first_steps"] == 4  # every turn's response took its first step
    elif mode == "converse":
        assert row["turns_without_audio"] == 0 and row["underruns"] is not None
        assert row["reply_audio_s"]["n"] == 2 and 0 < row["reply_audio_s"]["max"] <= 6 * 0.08 + 1e-6, row
    else:
        assert row["response_ms"]["n"] == 0  # no responses: the front end alone
    assert row["server_cpu_per_session"] is not None and row["client_cpu"] > 0
    assert (tmp_path / "rt.md").read_text().count("\n| 2 |") == 1 and (tmp_path / "rt.png").stat().st_size > 0


def test_bench_realtime_paused_speech_semantic_vad_against_server_vad(server, tmp_path):
    """`--speech paused --turn-detection ...`: sentences with a 600-900 ms pause mid-sentence; server_vad (500 ms)
    cuts every one at its pause (a false cut-in per turn), semantic_vad with noise reduction on cuts none, and every
    turn still ends after its last word."""
    rows = {}
    for td in ("server_vad", "semantic_vad"):
        run = subprocess.run([*OMNIRT, "bench", "realtime", "--url", server.url, "--sessions",
                              "2", "--turns", "1", "--clients", "1", "--mode", "no-responses", "--speech", "paused",
                              "--turn-detection", td, *(["--noise-reduction", "far_field"] if td == "semantic_vad"
                                                        else []), "--name", td, "--out", str(tmp_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        rows[td] = json.loads((tmp_path / f"{td}.json").read_text())["results"][0]
    for row in rows.values():
        assert row["turns"] == row["expected_turns"] == 2 and row["errors"] == 0, row["error_samples"]
        assert row["turn_end_ms"]["n"] == 2 and row["turn_end_ms"]["max"] > 0
    assert rows["server_vad"]["turns_cut"] == 2 and rows["semantic_vad"]["cut_ins"] == 0
    assert rows["semantic_vad"]["front_end"] == "semantic_vad (auto), far_field, paused speech"


def test_bench_realtime_with_and_without_transcripts(server, tmp_path):
    """`--transcription both`: each point runs without, then with transcripts of the user; with them every
    measured turn gets its transcript (none fails) and still its reply's audio."""
    run = subprocess.run([*OMNIRT, "bench", "realtime", "--url", server.url, "--sessions", "1",
                          "--turns", "1", "--clients", "1", "--transcription", "both", "--name", "tr",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    off, on = json.loads((tmp_path / "tr.json").read_text())["results"]
    assert (off["transcription"], on["transcription"]) == (False, True)
    for row in (off, on):
        assert row["turns"] == 1 and row["errors"] == 0 and row["turns_without_audio"] == 0, row
        assert row["response_ms"]["n"] == 1
    assert off["transcript_ms"]["n"] == 0 and on["transcript_ms"]["n"] == 1 and on["transcripts_failed"] == 0
    assert on["transcript_ms"]["p50"] > on["response_ms"]["p50"]  # the transcript starts after the first audio
    table = (tmp_path / "tr.md").read_text()
    assert "| off | 1/1 |" in table and "| on (0 failed) | 1/1 |" in table


def test_bench_realtime_abusive_session_leaves_others_whole(tmp_path):
    """16 spoken sessions, then the same 16 beside an abusive session that floods audio, sends malformed
    events and wrong-format audio, and stops reading, in turn: every normal turn is answered with audio
    and no normal session sees an error either time; the abuser gets its errors, and is closed (1008,
    with the reason) for the flood and for not reading."""
    # a 6 s burst: the flood (0.5 s appends as fast as the socket takes them) passes it within a second, while a
    # normal client whose process a loaded machine stalls for a few seconds does not, when it catches up
    srv = ServerProcess(["--realtime-audio-burst-s", "6", "--slow-client-timeout", "3",
                         "--realtime-max-sessions", "40"])
    try:
        run = subprocess.run([*OMNIRT, "bench", "realtime", "--url", srv.url,
                              "--sessions", "16", "--turns", "1", "--warmup-turns", "0", "--clients", "4",
                              "--abusive", "1", "--deaf-s", "60", "--name", "abuse", "--out", str(tmp_path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        slow = srv.metric("omnirt_sessions_total", state="slow_client")
        policy = srv.metric("omnirt_sessions_total", state="policy")
    finally:
        srv.stop()
    without, beside = json.loads((tmp_path / "abuse.json").read_text())["results"]
    assert (without["abusive"], beside["abusive"]) == (0, 1)
    for row in (without, beside):
        assert row["turns"] == row["expected_turns"] == 16 and row["errors"] == 0, row
        assert row["turns_without_audio"] == 0 and row["turns_without_speech_stopped"] == 0, row
    abuse = beside["abuse"]
    assert without["abuse"] == {} and set(abuse) == {"flood", "garbage", "deaf"}, abuse
    assert "input_audio_rate_exceeded" in abuse["flood"]["errors"], abuse
    assert any(c.startswith("1008 input audio arrives faster than 4x real time") for c in abuse["flood"]["closes"])
    garbage = set(abuse["garbage"]["errors"])
    assert {"invalid_json", "invalid_event_type", "invalid_base64", "invalid_audio_format"} <= garbage, abuse
    assert policy >= abuse["flood"]["connections"] and slow >= 1, (policy, slow, abuse)


def test_vad_lag_ends_every_turn_and_the_gate_none_later(capsys):
    """`python -m omnirt.loadtest.vad_lag`: at each alignment of the bench's utterance to the window grid the turn ends,
    no later with the level gate than with the probability alone; the report has a row for each."""
    from omnirt.app.audio.vad import QUIET_DB, SileroBatch
    from omnirt.loadtest.realtime_mic import utterance
    from omnirt.loadtest.vad_lag import lag_ms, main

    speech, model = utterance(None)[0], SileroBatch()
    for shift in (0, 256, 512):
        gated, alone = lag_ms(speech, shift, QUIET_DB, model), lag_ms(speech, shift, None, model)
        assert gated is not None and alone is not None and -40 <= gated <= alone  # a window early at most
    main(["--shifts", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3 and "never ended" not in "".join(rows)  # the header and the two detectors


def test_step_log_summary_per_span(tmp_path):
    """`python -m omnirt.loadtest.step_log`: a --step-log cut by the spans a GPU script prints (a point may come twice,
    each span named by its place), plain or gzipped, summarised per stage and kind."""
    import gzip

    from omnirt.loadtest.step_log import in_span, read_spans, read_steps, summarize

    lines = ["10.0 thinker prefill 2 120 40.0", "10.5 thinker decode 2 2 8.0", "11.0 thinker decode 1 1 6.0",
             "20.0 thinker prefill 1 60 30.0", "20.1 talker prefill 1 64 4.0", "30.0 thinker prefill 3 1 9.0"]
    log = tmp_path / "steps.log.gz"
    log.write_bytes(gzip.compress("\n".join(lines).encode()))
    calls = tmp_path / "call.log"
    calls.write_text("32 from 9.5\n32 | table row\n32 until 12\n64 from 19\n64 until 21\n32 from 25\n32 until 31\n")
    spans = read_spans(calls)
    assert [name for name, _, _ in spans] == ["1-32", "2-64", "3-32"]
    steps = read_steps(log)
    first = summarize(in_span(steps, *spans[0][1:]))
    assert [(r["stage"], r["kind"], r["steps"]) for r in first] == [("thinker", "prefill", 1), ("thinker", "decode", 2)]
    assert first[1]["rows_mean"] == 1.5 and first[1]["rows_max"] == 2 and first[1]["ms_max"] == 8.0
    assert [r["stage"] for r in summarize(in_span(steps, *spans[1][1:]))] == ["thinker", "talker"]
    assert summarize(in_span(steps, *spans[2][1:]))[0]["tokens_mean"] == 1.0


def test_bench_serves_a_named_variant_itself(tmp_path):
    """`omnirt bench --serve reference`: the bench starts transformers' generate() behind the API from this
    checkout on a free port, runs against it and stops it; the report names the variant, and the reference's
    points have no engine stages to report (the omnirt engine's do)."""
    from omnirt.loadtest.local_server import health

    run = subprocess.run([*OMNIRT, "bench", "--serve", "reference", "--serve-args",
                          "--threads 1", "--prompt-lens", "10", "--concurrency", "1", "--wave",
                          "--requests-per-point", "1", "--rounds", "1", "--warmup", "0", "--thinker-tokens", "4",
                          "--talker-frames", "6",
                          "--name", "ref", "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    port = re.search(r"--port (\d+)", run.stdout)[1]
    assert health(f"http://127.0.0.1:{port}") is None  # stopped with the run
    report = json.loads((tmp_path / "ref.json").read_text())
    [row] = report["results"]
    assert report["args"]["serve"] == "reference" and (row["ok"], row["failed"]) == (1, 0), row
    assert set(row["first_output_ms"]) == {"api"} and not row["engine"]["steps"], row


def test_variants_join_and_their_settings_reach_the_engine_config():
    """Variants joined by `+` give their `--set`s in order, and the server's config has each changed key (and the
    profile's value otherwise); an unknown name is refused."""
    from omnirt.app.cli import engine_options
    from omnirt.app.flags import build_parser
    from omnirt.loadtest.variants import VARIANTS, serve_args
    from tests.profiles import engine_config

    profile = ["--model", "qwen3-omni-30b-a3b", "--deploy-config", "qwen3_omni_moe_1gpu"]

    def config(spec: str):
        return engine_config(engine_options(build_parser().parse_args(["serve", *profile, *serve_args(spec)])), "cuda")

    shipped, cfg = config("profile"), config("fixed-ramp+sync-talker+c2w-eager")
    assert shipped.connector.codec_chunk_pacing == "adaptive" and cfg.connector.codec_chunk_pacing == "fixed"
    assert shipped.stage("talker").async_scheduling and not cfg.stage("talker").async_scheduling
    assert (cfg.conv_backend, cfg.stage("code2wav").enforce_eager) == ("native", True)
    assert cfg.stage("thinker") == shipped.stage("thinker")
    assert config("reference").engine == "reference" and not config("no-prefix-caching").stage("talker").prefix_caching
    assert serve_args("profile") == [] and "reference" in VARIANTS
    with pytest.raises(SystemExit, match="unknown variant 'no-such'"):
        serve_args("profile+no-such")
    small = config("48g")  # a 48 GB card: FP8, KV for 8 requests only
    assert (small.quantization, small.gpu_memory_utilization) == ("fp8", None)
    assert [small.stage(s).max_num_seqs for s in ("thinker", "talker", "code2wav")] == [8, 8, 8]


def test_ballast_leaves_what_it_is_asked_to_or_refuses():
    """`omnirt.loadtest.gpu.ballast` (a larger GPU standing in for a smaller one): it holds the free memory beyond
    what it leaves, and refuses a card with less free than that."""
    from omnirt.loadtest.gpu.ballast import GIB, hold_bytes

    assert hold_bytes(int(78.5 * GIB), 44.4) == int(78.5 * GIB) - int(44.4 * GIB)
    with pytest.raises(SystemExit, match="less than the 44.4 GiB"):
        hold_bytes(40 * GIB, 44.4)


def test_gpu_driver_resolves_every_scenario(tmp_path):
    """`python -m omnirt.loadtest.gpu --dry-run`: every scenario's steps resolve (their variants, values and modules),
    and a value no scenario of the run reads is refused, naming the ones they read."""
    import importlib.util

    from omnirt.loadtest.gpu.scenarios import SCENARIOS

    run = subprocess.run([sys.executable, "-m", "omnirt.loadtest.gpu", "--dry-run", "--out", str(tmp_path), *SCENARIOS,
                          "variants=profile no-graphs fixed-ramp+no-priority"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert [line[3:].split(":")[0] for line in run.stdout.splitlines() if line.startswith("== ")] == list(SCENARIOS)
    modules = set(re.findall(r" -m ([\w.]+)", run.stdout))
    assert {"omnirt.app.cli", "omnirt.loadtest.gpu.diag", "omnirt.loadtest.gpu.hf_parity", "pytest"} <= modules
    assert all(importlib.util.find_spec(m) for m in modules), modules
    assert "--enforce-eager" in run.stdout and "--set connector.codec_chunk_pacing=fixed" in run.stdout
    assert "{" not in "".join(line for line in run.stdout.splitlines() if "--stage-overrides" not in line)
    stray = subprocess.run([sys.executable, "-m", "omnirt.loadtest.gpu", "--dry-run", "sweep", "sessions=1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert stray.returncode == 2 and "sessions: no parameter of sweep" in stray.stderr, stray.stderr


def test_gpu_driver_exits_non_zero_naming_a_failed_step(tmp_path):
    """A step that fails does not stop the others, and the driver's exit says which failed (a device call's
    exit status is what its caller reads first)."""
    run = subprocess.run([sys.executable, "-m", "omnirt.loadtest.gpu", "--tiny", "--out", str(tmp_path), "gpu-tests",
                          "diag", "tests=tests/no_such_test.py", "concurrency=1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 1 and run.stderr.strip().endswith("failed: gpu-tests (exit 4)"), run.stderr[-2000:]
    assert "diag-profile rc=0" in (tmp_path / "diag-profile.txt").read_text()


def test_only_the_variants_table_spells_the_ablation_settings():
    """The serve settings of the ablations (`--set`, `--enforce-eager`) appear in omnirt/loadtest/ only in
    omnirt/loadtest/variants.py: one place to change; the flags they replaced appear nowhere."""
    flags = re.compile(r"--(set|no-async-chunk|no-async-output|no-first-packet-priority|no-prefix-caching|compile|"
                       r"attention|moe-backend|conv-backend|enforce-eager)\b|--engine reference")
    files = [p for p in (ROOT / "omnirt" / "loadtest").rglob("*")
             if p.suffix in (".py", ".sh") and p.name != "variants.py"]
    assert files and not [str(p) for p in files if flags.search(p.read_text())]


def test_tiny_voice_figures_of_a_known_signal():
    """`python -m omnirt.loadtest.tiny_voice` (the README's figures of the tiny model's voice) on a signal whose figures
    are known: a 9 kHz tone of amplitude 0.1 on an offset of +0.07."""
    import numpy as np

    from omnirt.loadtest.tiny_voice import RATE, describe, energy_bands

    x = 0.07 + 0.1 * np.sin(2 * np.pi * 9000 * np.arange(RATE) / RATE + 0.1)
    said = describe(x)
    assert "1.0 s, offset +0.070, swing +-0.071" in said and "min -0.03, max +0.17" in said, said
    negative = float(re.search(r"negative ([\d.]+)%", said).group(1))
    assert abs(negative - 100 * np.mean(x < 0)) < 0.1 and 20 < negative < 30  # asin(0.7)/pi below zero: 25 %
    assert "8-10 kHz 100%" in energy_bands(x) and "0-2 kHz 0%" in energy_bands(x)


def test_ab_log_plot_reads_the_chat_points_a_driver_log_printed(tmp_path):
    """`plot ab-log`: each chat row and its engine-steps line (as `omnirt bench` prints them into a driver log) give
    one point; other lines (the server's log, the other stages' steps) are passed over."""
    from omnirt.loadtest.plot import ab_log, log_points

    log = tmp_path / "ab.log"
    log.write_text(
        "server new ready after 158 s\n"
        "new-steady | 16-640 | distinct | 64 | steady | T 0.7, top-p 0.8, top-k 20 | 40.0 | 642 | 17.65 | 987 | 1175 | "
        "1296 | 0.314 | 0 | 27.5 (63) / 54.0 (64) / 13.8 (34) | 3644 | 747 | 11.6 | 103 (23-651) | thinker 530 |\n"
        "new-steady - prompt 16-640, c=64, engine steps over the window: thinker: 62 prefill steps x 168.2 ms, 966 "
        "decode x 18.9 ms; talker: 62 prefill steps x 53.9 ms\n"
        "new 2026-12-07T13:08:42.799Z INFO omnirt.memory: memory plan on cuda:0: 79.18 GiB total\n"
        "base-steady | 16-640 | distinct | 64 | steady | T 0.7, top-p 0.8, top-k 20 | 43.8 | 512 | 13.17 | 2827 | "
        "3009 | 3115 | 0.459 | 26 | 38.1 (64) / 54.8 (64) / 9.4 (34) | 5320 | 965 | 11.6 | 94 (23-656) | x |\n")
    points = log_points(log.read_text())
    assert points == {
        "new-steady": {"c": 64, "req/s": 17.65, "TTFP p50": 987, "TTFP p90": 1175, "TTFP p99": 1296, "RTF": 0.314,
                       "underruns": 0, "Thinker prefill step": 168.2},
        "base-steady": {"c": 64, "req/s": 13.17, "TTFP p50": 2827, "TTFP p90": 3009, "TTFP p99": 3115, "RTF": 0.459,
                        "underruns": 26}}
    ab_log(str(tmp_path / "ab.png"), str(log))
    assert (tmp_path / "ab.png").stat().st_size > 10_000


def test_audio_encoder_check_counts_the_operators_one_call_a_layer_saves():
    """`audio_encoder_check --device meta`: the released encoder's operators for the engine's call, attention per window
    against one call a layer. Eight utterances (eight windows) dispatch far fewer in one call; one utterance (one
    window) about as many."""
    import torch

    from omnirt.loadtest.gpu.audio_encoder_check import op_counts, released_tower

    tower = released_tower(torch.device("meta"), torch.bfloat16)
    with torch.inference_mode():
        one, eight = (op_counts(tower, n, torch.device("meta"), torch.bfloat16) for n in (1, 8))
    layers = len(tower.layers)
    assert eight["ops_per_window"] - eight["ops_one_call"] > 7 * layers * 3, eight  # >= 3 a window a layer saved
    assert abs(one["ops_per_window"] - one["ops_one_call"]) < 5 * layers, one
    assert eight["ops_one_call"] - one["ops_one_call"] < 2 * layers, (one, eight)  # not a few a window a layer


def test_audio_encoder_plot_reads_the_checks_json_lines(tmp_path, monkeypatch):
    """`plot audio-encoder`: a panel per timed batch line of `audio_encoder_check`'s output, each bar the ready time
    (the second figure of each pair), the engine's per-window call where it was timed; its other lines (the model
    line, a `--device meta` line of operator counts, the driver's rc line) are passed over."""
    from omnirt.loadtest import plot

    drawn = []
    monkeypatch.setattr(plot, "grouped_bars", lambda ax, groups, series, labels=False: drawn.append(series))
    check = tmp_path / "audio-encoder.txt"
    check.write_text('{"layers": 32, "params_m": 648, "attention": "sdpa"}\n'
                     '{"audios": 1, "seconds": 1.4, "equal": false, "transformers_idle": [27.68, 27.75], '
                     '"engine_idle": [15.49, 15.55], "transformers_busy": [43.32, 44.41], '
                     '"engine_busy": [48.7, 53.71]}\n'
                     '{"audios": 8, "seconds": 32.9, "equal": false, "transformers_idle": [91.63, 91.71], '
                     '"engine_idle": [34.36, 34.45], "transformers_busy": [132.86, 134.23], '
                     '"engine_busy": [78.99, 83.69], "engine_per_window_idle": [40.1, 40.2], '
                     '"engine_per_window_busy": [90.1, 90.2]}\n'
                     '{"audios": 8, "seconds": 32.9, "ops_per_window": 2249, "ops_one_call": 1245}\n'
                     "audio-encoder rc=0\n")
    plot.audio_encoder(str(tmp_path / "enc.png"), str(check))
    assert drawn == [{"transformers": [27.75, 44.41], "engine": [15.55, 53.71]},
                     {"transformers": [91.71, 134.23], "engine_per_window": [40.2, 90.2], "engine": [34.45, 83.69]}]
    assert (tmp_path / "enc.png").stat().st_size > 10_000
