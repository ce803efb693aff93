"""`omnirt bench realtime`: N concurrent voice sessions over the Realtime WebSocket (or WebRTC calls), as microphones.

In `--mode converse` (the default, the headline) each session behaves as a person does: it says one of the shipped
utterances in real time in 20 ms PCM16 chunks over its noise floor, waits for server VAD, plays the whole reply at
real time on the server's playback clock (counting underruns), thinks, and speaks again; sessions start spread over
a turn's length, warm-up turns are not counted, and those done with their measured turns converse on until all are
(`omnirt/loadtest/realtime_mic.py`). The sessions are spread over client processes so that the client is not the
bottleneck (its own CPU is reported). Per session count N it reports p50/p90/p99 (nearest rank; where the point has
too few turns for a p90 or p99, the maximum, labelled so: `omnirt/loadtest/stats.py`) of

- VAD lag: end of speech (the last speech chunk sent) -> `speech_stopped`, less the silence the turn detection
  must wait for (server_vad: its 500 ms; semantic_vad: the pause at which it asks its end-of-turn model);
- turn end: the same, in full (what the speaker waits for), and false cut-ins (`speech_stopped` while the
  utterance is still being sent: a turn ended inside a mid-sentence pause of `--speech paused`);
- response latency: `speech_stopped` -> first audio delta;
- voice-to-voice: end of speech -> first audio delta;

plus underruns per reply, turns that never got audio, `error` events, each stage's rows a step (mean and p90, from
the engine's counters), the GPU's use and the API process's CPU per session (from its /metrics), and whether
replies were pinned (`--reply-frames`); per turn of the conversation, response latency and the prompt tokens of the
turn's response, reused and prefilled; the server's prefill and first-output counters
(`omnirt/loadtest/server_metrics.py`); tables in `omnirt/loadtest/realtime_report.py`. Diagnostic modes: `cancel`
(each reply cancelled at its first audio) and `no-responses` (the front end alone). `--capacity` searches the most
sessions that pass (`omnirt/loadtest/capacity.py`); `--abusive` adds abusive sessions
(`omnirt/loadtest/realtime_abuse.py`). `--transcription on|both` asks for transcripts of the user and reports
their latency. JSON, markdown and a plot per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import time
from dataclasses import asdict

import numpy as np

from omnirt.loadtest import capacity, plot, server_metrics
from omnirt.loadtest.bench import say_plan, server_args, server_platform, write_report
from omnirt.loadtest.gpu_use import GpuUse
from omnirt.loadtest.local_server import serving
from omnirt.loadtest.realtime_abuse import abuse_summary, abusers_main
from omnirt.loadtest.realtime_mic import (
    FRAMES_PER_S,
    RATE,
    SILENCE_MS,
    ClientResult,
    WebRtcMic,
    WebSocketMic,
    session_update,
    utterances,
)
from omnirt.loadtest.realtime_report import front_end, markdown, replies, summarize

REPLY_GUESS_S = 4.0  # an unpinned reply's length, for the default --spread-s
TURN_LOG = ("session", "index", "speech_start", "speech_end", "speech_stopped", "first_audio", "played_until",
            "think_s", "audio_s", "underruns")  # each turn's times (perf_counter) in the JSON, warm-up turns too


def spread_s(args: argparse.Namespace) -> float:
    """Seconds over which the sessions' starts spread: `--spread-s`, else one turn's expected length (the mean
    utterance, the VAD's silence, the reply: pinned, or REPLY_GUESS_S, and the mean think time)."""
    if args.spread_s is not None:
        return args.spread_s
    speech = float(np.mean([len(a) / RATE for a in utterances(args)]))
    reply = args.reply_frames / FRAMES_PER_S if args.reply_frames else REPLY_GUESS_S
    return speech + SILENCE_MS / 1000 + reply + sum(args.think_s) / 2



async def _client(index: int, sessions: list[int], args: argparse.Namespace, start_at: float,
                  measured) -> ClientResult:
    """This process's sessions; in converse mode they are stopped once `measured` (shared by the processes)
    counts every session of the point."""
    import websockets

    result = ClientResult()
    audios = utterances(args)
    url = args.url.replace("http", "ws", 1) + f"/v1/realtime?model={args.model}"
    spread, counted = spread_s(args), set()

    def starts_at(i: int) -> float:
        return start_at + i * spread / args.num_sessions  # out of step from the first turn on

    def count(i: int) -> None:
        if i not in counted:
            counted.add(i)
            with measured.get_lock():
                measured.value += 1

    async def over_websocket(i: int) -> None:
        async with websockets.connect(url, max_size=None, open_timeout=60,
                                      additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            json.loads(await ws.recv())  # session.created
            await ws.send(json.dumps(session_update(args, i)))
            mic = WebSocketMic(ws, i, audios, args, result)
            mic.on_measured = lambda: count(i)
            await mic.run(starts_at(i))

    async def over_webrtc(i: int) -> None:
        mic = WebRtcMic(i, audios, args, result)
        await mic.connect(args.url)
        try:
            await mic.call.wait_for(lambda e: e["type"] == "session.created", 60)
            mic.call.send(session_update(args, i))
            mic.on_measured = lambda: count(i)
            await mic.run(starts_at(i))
        finally:
            await mic.call.close()

    async def one(i: int) -> None:
        try:
            await (over_webrtc if args.transport == "webrtc" else over_websocket)(i)
        except Exception as exc:  # a refused or dropped session is a result, not a crash
            result.errors.append(f"session {i}: {type(exc).__name__}: {exc}")

    tasks = [asyncio.create_task(one(i)) for i in sessions]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.1)
        if measured.value >= args.num_sessions:
            for t in tasks:
                t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    result.cpu_s = time.process_time()
    return result


def _client_main(index: int, sessions: list[int], args: argparse.Namespace, start_at: float, measured,
                 outbox) -> None:
    outbox.put(asdict(asyncio.run(_client(index, sessions, args, start_at, measured))))



def run_point(args: argparse.Namespace, n: int, abusive: int = 0, transcribe: bool = False) -> dict:
    """N sessions spread over the client processes (and `abusive` abusers in a process of their own, from
    before the first session starts until the last one ends), asking for transcripts or not; the row."""
    args = argparse.Namespace(**{**vars(args), "transcribe": transcribe, "num_sessions": n})
    clients = max(1, min(args.clients, n))
    ctx = multiprocessing.get_context("spawn")
    inbox, abuse_box, stop, measured = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("i", 0)
    abusers = ctx.Process(target=abusers_main, args=(abusive, args, stop, abuse_box)) if abusive else None
    if abusers is not None:
        abusers.start()
    before, t0 = server_metrics.settled_scrape(args.url), time.time()
    start_at = time.perf_counter() + 3.0  # perf_counter is one clock for every process of this host
    procs = [ctx.Process(target=_client_main, args=(c, list(range(c, n, clients)), args, start_at, measured, inbox))
             for c in range(clients)]
    for p in procs:
        p.start()
    with GpuUse() as gpu:
        results = _gather(procs, inbox)
    wall, cpu1 = time.time() - t0, server_metrics.cpu_seconds(server_metrics.scrape(args.url))
    cpu0, after = server_metrics.cpu_seconds(before), server_metrics.settled_scrape(args.url)
    stop.set()
    records = _gather([abusers], abuse_box)[0] if abusers is not None else []
    every = sorted((t for r in results for t in r["turns"]), key=lambda t: (t["session"], t["index"]))
    turns = [t for t in every if t["index"] >= args.warmup_turns]  # warm-up turns not counted
    row = summarize(n, turns, [e for r in results for e in r["errors"]], args,
                    server_cpu=(cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else None,
                    client_cpu=sum(r["cpu_s"] for r in results) / wall)
    return {**row, "abusive": abusive, "abuse": abuse_summary(records),
            "prefill_tokens": server_metrics.delta(server_metrics.prefill_tokens(after),
                                                   server_metrics.prefill_tokens(before)),
            "first_output_ms": server_metrics.first_output_ms(server_metrics.first_outputs(after),
                                                              server_metrics.first_outputs(before)),
            "engine": server_metrics.engine_counters(after, before),
            "rows_per_step": server_metrics.batch_sizes(after, before), "gpu_pct": gpu.mean_pct(),
            "turn_log": [{k: t[k] for k in TURN_LOG} for t in every]}



def _gather(procs: list, inbox) -> list[dict]:
    """Every client's result; a client process that died without one is an error, not a hang."""
    results: list[dict] = []
    while len(results) < len(procs):
        try:
            results.append(inbox.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a client process failed (exit code {dead[0].exitcode})") from None
    for p in procs:
        p.join()
    return results



SESSIONS = {"cpu": [1, 4], "gpu": [1, 8, 16]}  # session counts when none are given


def build_parser() -> argparse.ArgumentParser:
    from omnirt.app.flags import HelpFormatter

    p = argparse.ArgumentParser(prog="omnirt bench realtime", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    server_args(p)
    p.add_argument("--sessions", type=int, nargs="+", default=None, help="session counts to run, in turn (default: "
                   f"{' '.join(map(str, SESSIONS['gpu']))} on an accelerator, {' '.join(map(str, SESSIONS['cpu']))} "
                   "on a CPU server)")
    p.add_argument("--turns", type=int, default=5, help="turns per session that are measured")
    p.add_argument("--warmup-turns", type=int, default=1, help="turns per session before those, not counted "
                   "(a fresh server's first turns pay for one-time work)")
    p.add_argument("--mode", choices=("converse", "cancel", "no-responses"), default="converse",
                   help="converse: each session plays every reply to its end at real time, thinks, speaks again (the "
                        "headline); diagnostics: cancel (each reply cancelled at its first audio), no-responses (the "
                        "VAD alone)")
    p.add_argument("--reply-tokens", type=int, help="each reply's text at most this many tokens "
                   "(max_response_output_tokens; default: the server's limit)")
    p.add_argument("--reply-frames", type=int, help="each reply's speech at most this many codec frames (omnirt's "
                   "session talker_sampling; 12.5 a second): with random weights a reply rarely ends by itself")
    p.add_argument("--transport", choices=("websocket", "webrtc"), default="websocket",
                   help="webrtc: each session is an aiortc call whose microphone track carries the speech")
    p.add_argument("--clients", type=int, default=4, help="client processes the sessions are spread over")
    p.add_argument("--spread-s", type=float, help="seconds over which the sessions' starts spread, evenly (default: "
                   "one turn's expected length, so that they are out of step from the first turn)")
    p.add_argument("--think-s", type=float, nargs=2, default=(0.5, 3.0), metavar=("MIN", "MAX"),
                   help="seconds a session thinks after the reply played (after the turn's end in the diagnostic "
                        "modes) before speaking again: uniform, seeded per session")
    p.add_argument("--noise-db", default="-55", help="the microphones' noise floor, dBFS RMS, laid over all they send "
                   "(seeded per session; over WebRTC too, between and under utterances); off: digital zero between "
                   "utterances")
    p.add_argument("--wav", help="the utterance (any rate, mono or not) (default: an espeak-ng phrase)")
    p.add_argument("--speech", choices=("set", "plain", "paused"), default="set", help="set: the 26 shipped "
                   "utterances of 1.4-7.7 s, each session starting at its own; plain: the one espeak-ng phrase; "
                   "paused: sentences with a 600-900 ms pause mid-sentence, for turn end and false cut-ins")
    p.add_argument("--max-utterance-s", type=float, help="say only the set's utterances of at most this many seconds")
    p.add_argument("--turn-detection", choices=("server_vad", "semantic_vad"), default="server_vad",
                   help=f"the sessions' turn detection (server_vad: {SILENCE_MS} ms of silence ends a turn)")
    p.add_argument("--eagerness", choices=("low", "medium", "high", "auto"), default="auto",
                   help="semantic_vad's eagerness")
    p.add_argument("--noise-reduction", choices=("off", "near_field", "far_field"), default="off",
                   help="the sessions' input noise reduction (RNNoise)")
    p.add_argument("--turn-timeout", type=float, default=120.0, help="seconds a turn may take")
    p.add_argument("--abusive", type=int, default=0, help="also run each point with this many abusive sessions "
                   "beside the normal ones (flooding audio, malformed events, not reading), after the same point "
                   "without them")
    p.add_argument("--deaf-s", type=float, default=60.0, help="how long an abusive session reads nothing (long "
                   "enough for the kernel's socket buffers to fill)")
    p.add_argument("--transcription", choices=("off", "on", "both"), default="off",
                   help="on: the sessions ask for transcripts of the user (input_audio_transcription); both: each "
                        "point without, then with them")
    p.add_argument("--capacity", action="store_true", help="search the most sessions that pass: doubling from the "
                   "first --sessions, then bisecting (omnirt/loadtest/capacity.py)")
    p.add_argument("--latency-bound", type=float, default=800.0, help="--capacity: a point passes with p90 response "
                   "latency within this many ms, and no underrun, lost turn or error")
    p.add_argument("--max-sessions", type=int, default=512, help="--capacity: the most sessions it tries")
    p.add_argument("--name", default="realtime", help="the report's name")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    with serving(args):
        run_sessions(args)


def run_sessions(args: argparse.Namespace) -> None:
    platform = server_platform(args.url)
    args.sessions = args.sessions or SESSIONS["cpu" if platform == "cpu" else "gpu"]
    say_plan(args, f"{platform} server at {args.url}: {args.sessions} {args.transport} sessions x "
             f"({args.warmup_turns} + {args.turns}) turns, mode {args.mode}, {front_end(args)}, transcripts "
             f"{args.transcription}"
             f"{f', each point again beside {args.abusive} abusive' if args.abusive else ''}, replies {replies(args)}"
             f"{', capacity search' if args.capacity else ''} (--sessions to change)")
    if args.capacity:
        return _capacity(args)
    rows = []
    transcribing = {"off": (False,), "on": (True,), "both": (False, True)}[args.transcription]
    for n in args.sessions:
        for abusive in sorted({0, args.abusive}):
            for transcribe in transcribing:
                rows.append(run_point(args, n, abusive, transcribe))
                print(markdown(rows[-1:], f"{args.name}: {n} sessions, {abusive} abusive, transcripts "
                                          f"{'on' if transcribe else 'off'}"), flush=True)
    write_report(args, rows, markdown, plot.voice)


def _capacity(args: argparse.Namespace) -> None:
    """`--capacity`: the search's points, each printed as it ends, then the report with the last passing count."""

    def point(n: int) -> dict:
        row = run_point(args, n)
        print(markdown([row], f"{args.name}: {n} sessions"), flush=True)
        return row

    rows, last = capacity.search(point, args.sessions[0], args.max_sessions, args.latency_bound)
    write_report(args, rows, lambda rs, title: markdown(rs, title) + "\n" + capacity.markdown(rs, last,
                                                                                          args.latency_bound),
                 plot.voice)


if __name__ == "__main__":
    main()
