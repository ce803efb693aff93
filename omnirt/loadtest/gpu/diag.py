"""Full-size start-up plus a few timed requests in-process, with thread dumps if anything stalls."""
import asyncio
import faulthandler
import logging
import os
import sys
import time

from omnirt.app.cli import build_parser, engine_options
from omnirt.pipeline.api import AudioChunk, Finished, OmniRequest, TextDelta
from omnirt.pipeline.serving.core import build_engine

if os.environ.get("DIAG_LOG"):  # DIAG_LOG=INFO: the engine's start-up lines (memory plan, precision, graphs)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("omnirt").setLevel(os.environ["DIAG_LOG"])
if os.environ.get("SWITCH_MS"):  # the interpreter's GIL switch interval (default 5 ms), for the host-path ablation
    sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1000)
# DIAG_SWITCHES="5 0.2": each round (and the spans round) once per switch interval, in this order, same process
SWITCHES = os.environ.get("DIAG_SWITCHES", "").split() or [None]
dump = open(os.path.join(os.environ.get("OUT", "/tmp"), "stacks.txt"), "w")
faulthandler.dump_traceback_later(int(os.environ.get("DIAG_TIMEOUT", "200")), exit=True, file=dump)
t0, T_START = time.perf_counter(), time.time()
engine = build_engine(engine_options(build_parser().parse_args(["serve", *sys.argv[1:]])))
print(f"engine ready {time.perf_counter() - t0:.1f}s", flush=True)


UTTERANCES = None  # DIAG_AUDIO=1: the shipped utterances (16 kHz), a spoken turn's prompt instead of the text one


def content(i: int) -> str | list[dict]:
    """Request i's user content: 150 words of text, or with DIAG_AUDIO one of the shipped utterances (a voice
    turn: the audio encoder runs in its first prefill step, as at a Realtime turn's `speech_stopped`)."""
    global UTTERANCES
    if not os.environ.get("DIAG_AUDIO"):
        return "hello " * 150
    if UTTERANCES is None:
        from omnirt.loadtest.utterances import load

        UTTERANCES = load(16000)
    return [{"type": "audio", "audio": UTTERANCES[i % len(UTTERANCES)]}]


async def one(i: int, frames: int, first_audio_seen: asyncio.Event | None = None, waiting: list | None = None
              ) -> tuple[float, float, float]:
    """One request; returns (TTFP, total seconds, audio seconds). With `waiting` (a one-item count of the
    requests still owed their first audio), `first_audio_seen` is set once the last of them got it."""
    t = time.perf_counter()
    req = OmniRequest(f"d{i}", [{"role": "user", "content": content(i)}], ("text", "audio"),
                      thinker_sampling={"max_tokens": 40, "min_tokens": 40, "temperature": 0.0},
                      talker_sampling={"max_tokens": frames + 1, "min_tokens": frames + 1})
    first_text = first_audio = None
    n = 0
    async for ev in await engine.submit(req):
        now = time.perf_counter() - t
        if isinstance(ev, TextDelta) and first_text is None:
            first_text = now
        elif isinstance(ev, AudioChunk):
            if first_audio is None and waiting is not None:
                waiting[0] -= 1
                if waiting[0] == 0:
                    first_audio_seen.set()
            first_audio = first_audio or now
            n += ev.num_samples
        elif isinstance(ev, Finished) and (ev.error or os.environ.get("DIAG_VERBOSE")):
            print(f"req {i}: ttft {first_text} ttfp {first_audio} total {now:.2f} audio {n / 24000:.2f}s "
                  f"{ev.finish_reason} {ev.error}", flush=True)
    return first_audio or float("nan"), time.perf_counter() - t, n / 24000


def stage_stats() -> dict[str, tuple[int, int, float, float, int, float]]:
    """Per stage: steps, rows stepped, busy seconds, device-wait seconds, decode steps, decode seconds."""
    return {s.name: (c.num_steps, sum(b * n for b, n in enumerate(c.batch_size_counts)), c.busy_s, s.device_wait_s,
                     c.num_decode_steps, c.decode_busy_s) for s in engine.stages for c in (s.counters,)}


def allocator_line() -> str:
    """The caching allocator's counters since start: a retry frees every cached block and synchronises the device
    (every stage thread's next CUDA call waits), cudaMalloc and cudaFree calls, and what it holds."""
    import torch

    if not torch.cuda.is_available():
        return "allocator: no device"
    m, free = torch.cuda.memory_stats(), torch.cuda.mem_get_info()[0]
    return (f"allocator: {m.get('num_alloc_retries', 0)} retries, {m.get('num_device_alloc', 0)} cudaMalloc, "
            f"{m.get('num_device_free', 0)} cudaFree, reserved {m.get('reserved_bytes.all.current', 0) / 2**30:.1f} "
            f"GiB, free on the device {free / 2**30:.1f} GiB")


def triton_compiled_since(since: float) -> str:
    """Triton kernels compiled (written to its cache) since the wall-clock time `since`: a compile holds the
    interpreter lock, so every stage thread stalls while it runs."""
    import glob
    import json

    from triton import knobs

    names = []
    for path in glob.glob(os.path.join(knobs.cache.dir, "*", "*.json")):
        if os.path.getmtime(path) >= since and not os.path.basename(path).startswith("__grp__"):
            with open(path) as f:
                names.append(json.load(f).get("name", "?"))
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]  # torch.compile graphs made since start (a recompile adds one)
    return (f"triton: {len(names)} kernels compiled" + (f" ({', '.join(sorted(names))})" if names else "")
            + f"; torch.compile graphs since start {graphs}")


def print_stage_delta(before: dict, after: dict) -> None:
    for name, (steps, rows, busy, wait, dec, dec_s) in after.items():
        s0, r0, b0, w0, d0, ds0 = before[name]
        n = max(steps - s0, 1)
        decode = f", decode steps {1e3 * (dec_s - ds0) / (dec - d0):.1f} ms" if dec > d0 and name != "code2wav" else ""
        print(f"  {name}: {steps - s0} steps, mean batch {(rows - r0) / n:.1f}, {1e3 * (busy - b0) / n:.1f} ms/step "
              f"({1e3 * (wait - w0) / n:.1f} waiting for the device{decode}), busy {busy - b0:.1f}s", flush=True)


def replay_ms(cache, batch: int, inputs: dict, length: int = 301, n: int = 20) -> float | None:
    """Device time of one captured decode step at `batch` rows, on `inputs` (real routing, real slots, keys
    up to position `length`), from CUDA events around `n` replays."""
    import torch

    captured = cache._graphs.get((batch, cache.length_bucket(length)))
    if captured is None:
        return None
    for name, value in inputs.items():
        captured.inputs[name].copy_(value)
    captured.graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        captured.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def step_times(batches=(1, 16, 64), position: int = 300) -> None:
    """Each stage's captured decode step at batch 1/16/64, with random tokens (so the MoE routes as it does
    while serving, to many experts) over real slots whose keys reach `position`."""
    import torch

    th, tk = engine.models.thinker, engine.models.talker
    h = tk.past_hidden.shape[1]
    for b in batches:
        slots, pos = torch.arange(b, device="cuda"), torch.full((b,), position, device="cuda")
        ms = {
            "thinker": replay_ms(th.cuda_graphs, b, {"token_ids": torch.randint(0, th.vocab_size, (b,), device="cuda"),
                                                "slots": slots, "positions": pos, "rope_pos": pos}),
            "talker": replay_ms(tk.decode_graphs, b, {"embeds": torch.randn(b, 1, h, device="cuda") * 0.05,
                                                      "slots": slots, "positions": pos, "rope_pos": pos}),
            "predictor": replay_ms(tk.predictor_graphs, b, {"past": torch.randn(b, h, device="cuda"),
                                                            "code0": torch.randint(0, 2048, (b,), device="cuda")}),
        }
        print(f"step b={b}: " + ", ".join(f"{k} {v:.2f} ms" if v else f"{k} -" for k, v in ms.items()), flush=True)


def watch_syncs() -> None:
    """DIAG_SYNC=1: every operation that makes the host wait for the device warns, with the stack that did it."""
    import traceback
    import warnings

    import torch

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=8)[:-2])
        print(f"SYNC {category.__name__}: {message}\n{stack}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")


async def sampled_round(c: int) -> list:
    """One round of c requests; with DIAG_STACKS, the stage threads' stacks sampled throughout (stacks-c{c}.txt)."""
    sampler = None
    if os.environ.get("DIAG_STACKS"):
        from omnirt.loadtest.stack_sampler import StackSampler

        sampler = StackSampler()
        sampler.start()
    res = await asyncio.gather(*(one(100 * c + i, 145) for i in range(c)))
    if sampler is not None:
        sampler.stop()
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"stacks-c{c}.txt"), "w") as f:
            f.write(sampler.report())
    return res


async def main() -> None:
    print("warm-up: ttfp %.3fs total %.2fs audio %.2fs" % await one(0, 20), flush=True)
    print(f"  start-up and warm-up: {triton_compiled_since(T_START)}", flush=True)
    if os.environ.get("DIAG_SYNC"):
        watch_syncs()
    for c, switch_ms in [(int(x), ms) for x in os.environ.get("DIAG_CONC", "1 16 64").split() for ms in SWITCHES]:
        if switch_ms is not None:
            sys.setswitchinterval(float(switch_ms) / 1000)
        t, before, started = time.perf_counter(), stage_stats(), time.time()
        res = await sampled_round(c)
        wall = time.perf_counter() - t
        ttfp = sorted(r[0] for r in res)
        rtf = sum(r[1] / max(r[2], 1e-9) for r in res) / c
        label = "" if switch_ms is None else f" (switch interval {switch_ms} ms)"
        print(f"c={c}{label}: {c / wall:.2f} req/s, TTFP mean {sum(ttfp) / c:.3f}s p50 {ttfp[c // 2]:.3f}s "
              f"max {ttfp[-1]:.3f}s, RTF {rtf:.3f}, wall {wall:.1f}s", flush=True)
        print_stage_delta(before, stage_stats())
        print(f"  {allocator_line()}; {triton_compiled_since(started)}", flush=True)


async def profiled(c: int) -> None:
    """One more round at concurrency c under torch.profiler: the top ops by device and by host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        await asyncio.gather(*(one(900 + i, 145) for i in range(c)))
        wall = time.perf_counter() - t
    table = prof.key_averages()
    device_s = sum(e.self_device_time_total for e in table) / 1e6
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"profile-c{c}.txt"), "w") as f:
        f.write(f"wall {wall:.2f}s, device time (sum over kernels, all streams) {device_s:.2f}s\n\n")
        f.write(table.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70))
        f.write("\n\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    print(f"profiled c={c}: wall {wall:.2f}s, kernel time {device_s:.2f}s ({100 * device_s / wall:.0f}% of wall)",
          flush=True)


def _step_methods(stage) -> tuple[str, ...]:
    return ("launch", "collect") if stage.schedules_ahead else ("run",)


async def traced_round(c: int) -> None:
    """DIAG_TRACE=c: one more round of c requests with every stage step timed on the host (issue, wait, rows,
    prefill tokens) until the round's last first packet: which steps a first packet waited for.
    trace-c{c}.txt has the steps; stdout a summary per stage."""
    steps: list[tuple] = []

    def timed(stage: str, method: str, fn):
        def wrapper(arg):
            t = time.perf_counter()
            out = fn(arg)
            rows = len(arg.requests) if hasattr(arg, "requests") else None
            tokens = sum(arg.num_new_tokens) if getattr(arg, "is_prefill", False) else 0
            steps.append((stage, method, t, time.perf_counter(), rows, tokens))
            return out
        return wrapper

    for st in engine.stages:  # a synchronous stage's run() issues and waits; an async one's two halves apart
        for method in _step_methods(st):
            setattr(st.runner, method, timed(st.name, method, getattr(st.runner, method)))
    t0, started = time.perf_counter(), time.time()
    res = await asyncio.gather(*(one(800 + i, 145) for i in range(c)))
    last_first = max(r[0] for r in res)
    for st in engine.stages:  # back to the runners' own methods
        for method in _step_methods(st):
            st.runner.__dict__.pop(method, None)
    early = [s for s in steps if s[2] - t0 <= last_first]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"trace-c{c}.txt"), "w") as f:
        f.write("stage method start_ms end_ms rows prefill_tokens\n")
        for stage, method, a, b, rows, tokens in early:
            f.write(f"{stage} {method} {1e3 * (a - t0):.1f} {1e3 * (b - t0):.1f} {rows} {tokens}\n")
    ttfp = sorted(r[0] for r in res)
    print(f"  {allocator_line()}; {triton_compiled_since(started)}", flush=True)
    print(f"trace c={c}: TTFP min {1e3 * ttfp[0]:.0f} p50 {1e3 * ttfp[c // 2]:.0f} max {1e3 * ttfp[-1]:.0f} ms; "
          "steps before the last first packet:", flush=True)
    for st in engine.stages:
        for method in _step_methods(st):
            for prefill in (True, False):
                part = [s for s in early if s[0] == st.name and s[1] == method and (s[5] > 0) == prefill]
                if part:
                    ms = [1e3 * (b - a) for _, _, a, b, _, _ in part]
                    print(f"  {st.name} {method} {'prefill' if prefill else 'other'}: {len(part)} calls, "
                          f"{sum(ms):.0f} ms (mean {sum(ms) / len(ms):.1f}, max {max(ms):.1f}), "
                          f"first from {1e3 * (part[0][2] - t0):.0f} ms, rows {sum(p[4] or 0 for p in part)}, "
                          f"prefill tokens {sum(p[5] for p in part)}", flush=True)


SPANS = {  # DIAG_SPANS: (stage, path of the object from its runner, method)
    "thinker": [("runner", "launch"), ("runner", "collect"), ("runner.model", "prepare"),
                ("runner.model", "_prefill"), ("runner.model", "_decode"), ("runner.model.prefill", "of_requests"),
                ("runner.model.prefill", "run"), ("runner.model", "complete"), ("scheduler", "schedule")],
    "talker": [("runner", "launch"), ("runner", "collect"), ("runner.model", "prepare"),
               ("runner.model", "_prefill"), ("runner.model", "_decode"), ("runner.model.prefill", "run"),
               ("scheduler", "schedule")],
    "code2wav": [("runner", "run"), ("scheduler", "schedule")],
}


def _resolve(stage, path: str):
    obj = stage
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


async def spans_round(c: int, suffix: str = "") -> None:
    """DIAG_SPANS=c: one more round of c requests with the stage threads' main methods timed on the host (wall
    time per call, until the round's last first packet: where a first packet's time goes inside each step), and
    the first Thinker prefill step of 8 rows or more run under torch.profiler (its own thread's ops, with the
    spans as ranges; a device sync before and after it): spans-c{c}.txt, thinker-prefill-profile.txt. Below c=16
    the first prefill step of c/2 rows or more is profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    calls: list[tuple[str, float, float]] = []
    patched: list[tuple[object, str]] = []
    profiled: list[str] = []

    def timed(label: str, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            with record_function(label):
                out = fn(*args, **kwargs)
            calls.append((label, t, time.perf_counter()))
            return out
        return wrapper

    def profiling(fn):
        def wrapper(batch):
            if profiled or not batch.is_prefill or len(batch.requests) < min(8, max(1, c // 2)):
                return fn(batch)
            sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                out = fn(batch)
                sync()
                wall = time.perf_counter() - t
            # the report is built after the round: building it here held the interpreter for ~0.5 s
            profiled.append((f"thinker prefill step, {len(batch.requests)} rows, {sum(batch.num_new_tokens)} "
                             f"tokens: {1e3 * wall:.1f} ms with a sync at its end\n\n", prof))
            return out
        return wrapper

    by_name = {st.name: st for st in engine.stages}
    for name, methods in SPANS.items():
        for path, method in methods:
            obj = _resolve(by_name[name], path)
            setattr(obj, method, timed(f"{name}.{path.split('.')[-1]}.{method}", getattr(obj, method)))
            patched.append((obj, method))
    runner = by_name["thinker"].runner
    runner.launch = profiling(runner.launch)
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(600 + i, 145) for i in range(c)))
    last_first = max(r[0] for r in res)
    for obj, method in patched + [(runner, "launch")]:
        obj.__dict__.pop(method, None)
    out = os.environ.get("OUT", "/tmp")
    early = [(label, a - t0, b - t0) for label, a, b in calls if a - t0 <= last_first]
    with open(os.path.join(out, f"spans-c{c}{suffix}.txt"), "w") as f:
        f.write(f"until the last first packet: {1e3 * last_first:.0f} ms\nspan calls total_ms mean_ms max_ms\n")
        for label in dict.fromkeys(label for label, _, _ in early):
            ms = [1e3 * (b - a) for name, a, b in early if name == label]
            f.write(f"{label} {len(ms)} {sum(ms):.1f} {sum(ms) / len(ms):.2f} {max(ms):.1f}\n")
        f.write("\nlabel start_ms end_ms\n")
        f.writelines(f"{label} {1e3 * a:.1f} {1e3 * b:.1f}\n" for label, a, b in early)
    with open(os.path.join(out, f"thinker-prefill-profile{suffix}.txt"), "w") as f:
        if not profiled:
            f.write(f"no Thinker prefill step of {min(8, max(1, c // 2))} rows or more\n")
        for head, prof in profiled:
            table = prof.key_averages()
            f.write(head + table.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70) + "\n\n"
                    + table.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    print(f"spans c={c}{suffix}: last first packet {1e3 * last_first:.0f} ms (spans-c{c}{suffix}.txt)", flush=True)


async def profiled_first_packets(c: int) -> None:
    """DIAG_FIRST_PROFILE=c: one more round of c under torch.profiler, stopped once every request has its first
    audio: the kernels and CUDA calls that first packets wait for (first-packets-c{c}.txt, and the timeline as a
    Chrome trace, first-packets-c{c}.json.gz), and the stage threads' Python stacks over the same window
    (stacks-first-c{c}.txt; the profiler records no Python-level ops of threads it did not start)."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    from omnirt.loadtest.stack_sampler import StackSampler

    seen, waiting, sampler = asyncio.Event(), [c], StackSampler()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    sampler.start()
    t = time.perf_counter()
    round_ = asyncio.gather(*(one(700 + i, 145, seen, waiting) for i in range(c)))
    await seen.wait()
    wall = time.perf_counter() - t
    sampler.stop()
    prof.stop()
    await round_
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"stacks-first-c{c}.txt"), "w") as f:
        f.write(sampler.report(top=40))
    table = prof.key_averages()
    with open(os.path.join(out, f"first-packets-c{c}.txt"), "w") as f:
        f.write(f"until the last first packet: {wall:.3f}s\n\n")
        f.write(table.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=90))
        f.write("\n\n")
        f.write(table.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
    trace = os.path.join(out, f"first-packets-c{c}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    print(f"profiled first packets c={c}: {wall:.3f}s", flush=True)


async def main_and_profile() -> None:
    await main()
    if os.environ.get("DIAG_STEPS"):
        import torch

        with torch.inference_mode():  # the graphs' static inputs are inference tensors
            step_times()
    if os.environ.get("DIAG_TRACE"):
        await traced_round(int(os.environ["DIAG_TRACE"]))
    for switch_ms in SWITCHES if os.environ.get("DIAG_SPANS") else ():
        if switch_ms is not None:
            sys.setswitchinterval(float(switch_ms) / 1000)
        await spans_round(int(os.environ["DIAG_SPANS"]), "" if switch_ms is None else f"-s{switch_ms}")
    if os.environ.get("DIAG_FIRST_PROFILE"):
        await profiled_first_packets(int(os.environ["DIAG_FIRST_PROFILE"]))
    if os.environ.get("DIAG_PROFILE"):
        await profiled(int(os.environ["DIAG_PROFILE"]))


asyncio.run(main_and_profile())
faulthandler.cancel_dump_traceback_later()
engine.stop()
