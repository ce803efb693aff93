"""The benchmarks' plots: one function per kind, each also a command.

    python -m omnirt.loadtest.plot compare OUT.png RUN.json[=LABEL] ...      runs of either bench, overlaid
    python -m omnirt.loadtest.plot first-packet OUT.png RUN.json[=LABEL] ... where first packets wait, a bar per point
    python -m omnirt.loadtest.plot ablation OUT.png RUN.json=LABEL ...       one bar per server variant at the highest
                                                                      concurrency, beside vLLM-Omni's published row
    python -m omnirt.loadtest.plot steps OUT.png DIAG.txt                    captured decode steps per stage and batch
    python -m omnirt.loadtest.plot variants OUT.png C2W.jsonl                Code2Wav variants' speed-up per shape
    python -m omnirt.loadtest.plot ab-log OUT.png DRIVER.log                 the chat points a GPU driver log printed,
                                                                      side by side (req/s, TTFP, prefill steps)
    python -m omnirt.loadtest.plot fp8-accuracy OUT.png RESULT.json          each MoE layer's FP8 error against its
                                                                      bound and the reversed-scale control
    python -m omnirt.loadtest.plot audio-encoder OUT.png CHECK.txt           the audio encoder: transformers' call
                                                                      against the engine's, idle and busy

RUN.json is what `omnirt bench` or `omnirt bench realtime` wrote; a run's label is the given one, else the file's
name. `omnirt bench` draws `chat`, `omnirt bench realtime` `voice` and `python -m omnirt.loadtest.step_log`
`prefill_steps` beside their reports. Every figure is drawn on its own (matplotlib's Agg backend) and saved at 110 dpi.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from omnirt.loadtest.server_metrics import rows_per_step

CHAT = [("req_per_s", "requests / s"), ("ttfp_mean_ms", "mean audio TTFP (ms)"), ("rtf_mean", "mean RTF")]
VOICE = [("vad_lag_ms", "VAD lag (ms)"), ("response_ms", "response latency (ms)"),
         ("voice_to_voice_ms", "voice-to-voice (ms)")]
STAGES = {"thinker": "-", "talker": "--", "code2wav": ":"}  # rows a step: a line style per stage
SEGMENTS = [("thinker", "Thinker: first token"), ("talker", "Talker: first frame"),
            ("code2wav", "Code2Wav: first PCM"), ("api", "API process"), ("client", "HTTP to the client")]
PUBLISHED = (11.7, 632, 0.47)  # vLLM-Omni's blog: Qwen3-Omni-30B-A3B, 3 GPUs, c=64, every layer on


def _figure(rows: int, cols: int, width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)


def _save(fig, path: Path | str, title: str | None = None) -> None:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _grid(ax, xlabel: str, ylabel: str, legend: bool = True) -> None:
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _runs(args: list[str]) -> list[tuple[list[dict], str]]:
    """(rows, label) of each RUN.json[=LABEL]."""
    return [(json.loads(Path(path).read_text())["results"], label or Path(path).stem)
            for path, _, label in (arg.partition("=") for arg in args)]


# `omnirt bench`: req/s, TTFP and RTF against concurrency, and the requests each stage's steps held


def _chat_panels(axes, series: list[tuple[str, list[dict]]]) -> None:
    batching = any(r.get("engine") for _, rows in series for r in rows)
    for i, (label, rows) in enumerate(series):
        c = [r["concurrency"] for r in rows]
        for ax, (key, _) in zip(axes, CHAT):
            ax.plot(c, [r[key] for r in rows], marker="o", color=f"C{i}", label=label)
        for stage, style in STAGES.items() if batching else ():
            axes[3].plot(c, [rows_per_step(r.get("engine") or {}, stage) for r in rows], marker=".", color=f"C{i}",
                         linestyle=style, label=f"{label}, {stage}")
    for ax, (_, name) in zip(axes, CHAT + [(None, "requests a step")]):
        _grid(ax, "concurrency", name, legend=ax is axes[0] or ax is axes[3])
    axes[3].set_visible(batching)


def chat(rows: list[dict], path: Path, title: str) -> None:
    """One `omnirt bench` run: a line per prompt length; a diagnostic run's shapes in the title."""
    fig, axes = _figure(1, 4, 3.9, 4)
    _chat_panels(axes[0], [(f"prompt {n}", [r for r in rows if r["prompt_len"] == n and r["ok"]])
                           for n in sorted({r["prompt_len"] for r in rows})])
    diagnostic = sorted({d for r in rows for d in r.get("diagnostic", [])})
    _save(fig, path, f"{title} (diagnostic: {', '.join(diagnostic)})" if diagnostic else title)


# `omnirt bench realtime`: latencies against sessions, and per turn of the conversation


def _quantile(row: dict, key: str, q: str = "p90") -> float | None:
    """A voice figure's quantile, its maximum where the point has too few turns for it."""
    v = row[key]
    return v[q] if v[q] is not None else v.get("max")


def has_turns(rows: list[dict]) -> bool:
    """Whether the rows have several answered turns to draw against the turn index."""
    return any(len(r.get("by_turn") or []) > 1 and r["mode"] != "no-responses" for r in rows)


def turns(latency_ax, tokens_ax, rows: list[dict], label: str) -> None:
    """Response latency p50, and prefilled prompt tokens, against the turn of the conversation: a line per
    session count (abuse-free rows only)."""
    for r in rows:
        if r.get("abusive") or not r.get("by_turn"):
            continue
        x = [t["turn"] for t in r["by_turn"]]
        name = f"{label}{r['sessions']} sessions{', transcripts' if r.get('transcription') else ''}"
        latency_ax.plot(x, [t["response_ms"]["p50"] for t in r["by_turn"]], marker="o", label=name)
        tokens_ax.plot(x, [t["prefilled_tokens"] for t in r["by_turn"]], marker="o", label=name)
    _grid(latency_ax, "turn of the conversation", "response latency p50 (ms)")
    _grid(tokens_ax, "turn of the conversation", "prompt tokens prefilled (mean)")


def _voice_figure(runs: list[tuple[list[dict], str]], draw) -> tuple:
    """A row of the VOICE panels that have figures (`draw(ax, key, rows, label)` per run), and a second row per
    turn of the conversation where a run has several turns."""
    panels = [(k, name) for k, name in VOICE if any(r[k]["p50"] is not None for rows, _ in runs for r in rows)]
    by_turn = any(has_turns(rows) for rows, _ in runs)
    fig, axes = _figure(1 + by_turn, max(len(panels), 2 if by_turn else 1), 5, 4)
    for ax, (key, name) in zip(axes[0], panels):
        for rows, label in runs:
            draw(ax, key, sorted(rows, key=lambda r: r["sessions"]), label)
        _grid(ax, "sessions", name)
    for ax in [*axes[0][len(panels):], *(axes[1][2:] if by_turn else [])]:
        ax.set_visible(False)
    for rows, label in runs if by_turn else ():
        turns(axes[1][0], axes[1][1], rows, f"{label}, " if len(runs) > 1 else "")
    return fig, axes


def voice(rows: list[dict], path: Path, title: str) -> None:
    """One `omnirt bench realtime` run: p50/p90/p99/max per point, a line style per abuse and transcripts."""
    def draw(ax, key, rows, _):
        for abusive, transcribe in sorted({(r.get("abusive", 0), bool(r.get("transcription"))) for r in rows}):
            part = [r for r in rows if r.get("abusive", 0) == abusive and bool(r.get("transcription")) == transcribe]
            tags = [*([f"{abusive} abusive"] if abusive else []), *(["transcripts"] if transcribe else [])]
            for q in ("p50", "p90", "p99", "max"):  # a percentile the point has too few turns for is left out
                ax.plot([r["sessions"] for r in part], [r[key].get(q) for r in part], marker="o",
                        linestyle="--" if abusive else ":" if transcribe else "-", label=", ".join([q, *tags]))

    fig, _ = _voice_figure([(rows, title)], draw)
    _save(fig, path, title)


def compare(out: str, runs: list[str]) -> None:
    """Runs of one bench overlaid, a line per run: chat at its first prompt length; voice at p90."""
    loaded = _runs(runs)
    if "sessions" not in loaded[0][0][0]:
        fig, axes = _figure(1, 4, 3.9, 4)
        _chat_panels(axes[0], [(label + (" (diagnostic)" if rows[0].get("diagnostic") else ""),
                                sorted((r for r in rows if r["prompt_len"] == rows[0]["prompt_len"]),
                                       key=lambda r: r["concurrency"])) for rows, label in loaded])
        _save(fig, out)
        return

    def draw(ax, key, rows, label):
        rows = [r for r in rows if not r.get("abusive")]
        ax.plot([r["sessions"] for r in rows], [_quantile(r, key) for r in rows], marker="o", label=f"{label}, p90")

    fig, axes = _voice_figure(loaded, draw)
    axes[0][0].set_yscale("log")  # a front end that falls behind does so by orders of magnitude
    _save(fig, out)


# where first packets wait; server variants side by side


def first_packet(out: str, runs: list[str]) -> None:
    """A horizontal bar per `omnirt bench` point, cut where each stage gave its first output (the engine's mean
    time from submission), then the API process's first audio, then the client's TTFP."""
    bars = []
    for rows, label in _runs(runs):
        for row in rows:
            firsts = row.get("first_output_ms") or {}
            if firsts and row.get("ttfp_mean_ms") is not None:
                ends = [e for e in [firsts.get(name) for name, _ in SEGMENTS[:-1]] + [row["ttfp_mean_ms"]]
                        if e is not None]
                bars.append((f"{label}, c={row['concurrency']}", [b - a for a, b in zip([0.0, *ends], ends)]))
    fig, axes = _figure(1, 1, 11, 0.5 * len(bars) + 1.6)
    ax = axes[0][0]
    for y, (_, lengths) in enumerate(bars):
        left = 0.0
        for i, width in enumerate(lengths):
            ax.barh(y, width, left=left, color=f"C{i}", label=SEGMENTS[i][1] if y == 0 else None)
            left += width
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    _grid(ax, "mean ms from the request (client TTFP at the bar's end)", "", legend=False)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, out, "Where first packets wait")


def ablation(out: str, runs: list[str]) -> None:
    """req/s, mean TTFP and mean RTF of each variant's run at its highest concurrency, beside vLLM-Omni's
    published three-GPU row (each variant here is one layer off, not the blog's cumulative steps)."""
    loaded = [(label, max(rows, key=lambda r: r["concurrency"])) for rows, label in _runs(runs)]
    fig, axes = _figure(1, 3, max(5, 0.9 * len(loaded)), 4.2)
    for ax, (key, name), published in zip(axes[0], CHAT, PUBLISHED):
        ax.bar([label for label, _ in loaded], [row[key] for _, row in loaded], color="tab:blue",
               label=f"omnirt, one GPU, c={loaded[0][1]['concurrency']}")
        ax.axhline(published, color="tab:orange", ls="--", label="vLLM-Omni, 3 GPUs, c=64 (published)")
        ax.tick_params(axis="x", labelsize=8, labelrotation=25)
        _grid(ax, "", name, legend=False)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)  # clear of the bars
    fig.suptitle("One layer off at a time, 11.6 s of audio per reply")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=110)


# in-process timings: captured decode steps, Code2Wav variants, prefill steps of a step log


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], labels: bool = False) -> None:
    """One bar per series in each group, side by side, the group's name under them (values above with labels)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar([j + i * width for j in range(len(groups))], values, width, label=name)
        if labels:
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups)
    ax.legend(fontsize=8)


def diag_steps(text: str) -> dict[str, dict[int, dict[str, float]]]:
    """run name -> batch -> stage -> ms, from diag's `step b=N: thinker X ms, ...` lines; each run of the text
    ends with a `NAME rc=` line."""
    runs, current = {}, {}
    for line in text.splitlines():
        if m := re.match(r"^step b=(\d+): (.*)$", line):
            current[int(m[1])] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) ms", m[2])}
        elif (m := re.match(r"^(\S+) rc=", line)) and current:
            runs[m[1]], current = current, {}
    return runs


def steps(out: str, path: str) -> None:
    """Captured decode-step times per stage and batch, a bar per run (diag's DIAG_STEPS=1)."""
    runs = diag_steps(Path(path).read_text())
    stages = sorted({s for r in runs.values() for b in r.values() for s in b})
    batches = sorted({b for r in runs.values() for b in r})
    fig, axes = _figure(1, len(stages), 4.5, 3.8)
    for ax, stage in zip(axes[0], stages):
        grouped_bars(ax, [f"b={b}" for b in batches],
                     {name: [run.get(b, {}).get(stage, 0) for b in batches] for name, run in runs.items()})
        ax.set(title=f"{stage} decode step", ylabel="ms (captured graph replay)")
    _save(fig, out)


def variants(out: str, path: str) -> None:
    """Code2Wav variants' speed-up on eager per shape (c2w_variants' JSON lines)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    shapes = list(dict.fromkeys(f"{r['batch']}x{r['frames']}" for r in rows))
    speedup = {(r["variant"], f"{r['batch']}x{r['frames']}"): r["speedup"] for r in rows}
    names = dict.fromkeys(r["variant"] for r in rows)
    fig, axes = _figure(1, 1, 7, 3.8)
    ax = axes[0][0]
    grouped_bars(ax, [f"batch {s.replace('x', ', ')} frames" for s in shapes],
                 {name: [speedup.get((name, s), 0) for s in shapes] for name in names}, labels=True)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(ylabel="speed-up on eager (ms per decode call)", title="Code2Wav, one GPU, bf16")
    _save(fig, out)


# a chat row as `omnirt bench` prints it: name | prompt tokens | prompts | c | load | sampling | window s | ok |
# req/s | TTFP p50 | p90 | p99 | RTF | underruns | ...; and its engine-steps line
CHAT_ROW = re.compile(r"^(\S+) \| [^|]+ \| [^|]+ \| (\d+) \|(?: [^|]+ \|){4} ([\d.]+) \| (\d+) \| (\d+) \| (\d+) \| "
                      r"([\d.]+) \| (\d+) \|")
PREFILL = re.compile(r"^(\S+) - .*engine steps over the window: thinker: \d+ prefill steps x ([\d.]+) ms")


def log_points(text: str) -> dict[str, dict[str, float]]:
    """name -> the figures of that chat point, from the rows and engine-steps lines of a driver log."""
    points: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if m := CHAT_ROW.match(line):
            points[m[1]] = dict(zip(("c", "req/s", "TTFP p50", "TTFP p90", "TTFP p99", "RTF", "underruns"),
                                    map(float, m.groups()[1:])))
        elif (m := PREFILL.match(line)) and m[1] in points:
            points[m[1]]["Thinker prefill step"] = float(m[2])
    return points


def ab_log(out: str, path: str) -> None:
    """The chat points of one driver log (e.g. `ab-steady`'s builds) side by side: req/s, TTFP and the Thinker's
    prefill step time."""
    points = log_points(Path(path).read_text())
    panels = [("requests / s", ["req/s"]), ("ms", ["TTFP p50", "TTFP p90", "TTFP p99", "Thinker prefill step"])]
    fig, axes = _figure(1, 2, 5.5, 3.8)
    for ax, (unit, keys) in zip(axes[0], panels):
        grouped_bars(ax, keys, {name: [p.get(k, 0) for k in keys] for name, p in points.items()}, labels=True)
        ax.set(ylabel=unit)
        ax.tick_params(axis="x", labelsize=8)
    _save(fig, out, f"chat steady state, c={int(next(iter(points.values()))['c'])}")


def fp8_accuracy(out: str, path: str) -> None:
    """Each MoE layer's relative RMS error in FP8 (a prompt's rows, a decode step's, and with reversed scales),
    against the bound, a panel per stack (`omnirt.loadtest.gpu.fp8_accuracy`'s JSON)."""
    from omnirt.loadtest.gpu.fp8_accuracy import DECODE_ROWS, LAYER_BOUND

    result = json.loads(Path(path).read_text())
    series = (("layers", f"{result['prompts']} x {result['tokens']} rows", "o"),
              ("decode_layers", f"{DECODE_ROWS} rows (a decode step)", "."), ("broken_layers", "scales reversed", "x"))
    fig, axes = _figure(1, 2, 5.5, 3.8)
    for ax, stack in zip(axes[0], ("thinker", "talker")):
        for key, label, marker in series:
            ax.plot([100 * e for e in result[key][stack]], marker, ms=4, label=label)
        ax.axhline(100 * LAYER_BOUND, color="grey", linestyle="--", linewidth=0.8, label="bound")
        logits = result[stack]
        ax.set(title=f"{stack}: logits {100 * logits['relative_rms'][0]:.1f} %, top-1 same on "
                     f"{100 * logits['agree_where_decisive']:.1f} % of decisive", ylim=(0, None))
        ax.title.set_fontsize(9)
        _grid(ax, "MoE layer", "relative RMS error (%)")
    _save(fig, out, f"{result['model']}: FP8 against {result['dtype']}, same weights, teacher-forced")


def audio_encoder(out: str, path: str) -> None:
    """Milliseconds until the audio encoder's rows are ready, transformers' call against the engine's (and, where the
    check timed it, the engine's with the attention per window), on an idle and a busy device, a panel per batch
    (`omnirt.loadtest.gpu.audio_encoder_check`'s JSON lines)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith('{"audios"')]
    rows = [row for row in rows if "engine_idle" in row]  # a `--device meta` run counts operators only
    fig, axes = _figure(1, len(rows), 4.5, 3.8)
    for ax, row in zip(axes[0], rows):
        who = [w for w in ("transformers", "engine_per_window", "engine") if f"{w}_idle" in row]
        grouped_bars(ax, ["idle", "busy device"], {w: [row[f"{w}_{load}"][1] for load in ("idle", "busy")]
                                                    for w in who}, labels=True)
        ax.set(title=f"{row['audios']} audio(s), {row['seconds']} s")
        _grid(ax, "", "ms until the rows are ready", legend=False)
    _save(fig, out, "audio encoder, full size: one call")


def prefill_steps(spans: list[tuple[str, list]], path: Path, stage: str = "thinker") -> None:
    """A step log's prefill steps of one stage: ms against tokens, a colour per span; requests per step over
    each span's time."""
    fig, axes = _figure(1, 2, 6.5, 4.5)
    left, right = axes[0]
    for name, all_steps in spans:
        pre = [s for s in all_steps if s.stage == stage and s.kind == "prefill"]
        if pre:
            left.scatter([s.tokens for s in pre], [s.ms for s in pre], s=10, alpha=0.6, label=name)
            right.plot([s.at - pre[0].at for s in pre], [s.rows for s in pre], marker=".", lw=0.6, label=name)
    left.set(title=f"{stage} prefill steps", yscale="log")
    right.set(title=f"{stage} prefill: new requests per step")
    _grid(left, "tokens in the step", "ms")
    _grid(right, "seconds into the span", "requests in the step")
    _save(fig, path)


KINDS = {"compare": compare, "first-packet": first_packet, "ablation": ablation, "steps": steps, "variants": variants,
         "ab-log": ab_log, "fp8-accuracy": fp8_accuracy, "audio-encoder": audio_encoder}

if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] not in KINDS:
        sys.exit(__doc__)
    kind, out, *inputs = sys.argv[1:]
    KINDS[kind](out, inputs if kind in ("compare", "first-packet", "ablation") else inputs[0])
    print(f"plot: {out}")
