"""Overlay `omnirt bench` runs of the same sweep (req/s, mean audio TTFP and mean RTF against concurrency), or
`omnirt bench realtime` runs (VAD lag, response latency and voice-to-voice p90 against sessions; for runs of
several turns also response latency p50 and prefilled prompt tokens against the turn of the conversation).

    python -m loadtest.plot_compare OUT.png FILE.json[=LABEL] ...

One line per run (its label: the given one, else the file's name); one point per concurrency of each
run's first prompt length.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.realtime_bench import has_turns, plot_turns  # noqa: E402

CHAT = [("req_per_s", "requests / s"), ("ttfp_mean_ms", "mean audio TTFP (ms)"), ("rtf_mean", "mean RTF")]
VOICE = [("vad_lag_ms", "VAD lag p90 (ms; max below 10 turns)"),
         ("response_ms", "response latency p90 (ms; max below 10 turns)"),
         ("voice_to_voice_ms", "voice-to-voice p90 (ms; max below 10 turns)")]


def _points(results: list[dict]) -> tuple[str, list[dict]]:
    """The x axis and the rows to draw: sessions for `omnirt bench realtime`, else concurrency at the first
    prompt length of `omnirt bench`."""
    if "sessions" in results[0]:
        return "sessions", sorted((r for r in results if not r.get("abusive")), key=lambda r: r["sessions"])
    return "concurrency", sorted((r for r in results if r["prompt_len"] == results[0]["prompt_len"]),
                                 key=lambda r: r["concurrency"])


def _value(row: dict, key: str) -> float | None:
    """A chat figure, or a voice figure's p90 (its maximum where the point has too few turns for one)."""
    v = row[key]
    if not isinstance(v, dict):
        return v
    return v["p90"] if v["p90"] is not None else v.get("max")


def main(out: str, runs: list[str]) -> None:
    loaded = [(json.loads(Path(path).read_text())["results"], label or Path(path).stem)
              for path, _, label in (run.partition("=") for run in runs)]
    by_turn = any(has_turns(results) for results, _ in loaded)
    fig, axes = plt.subplots(1 + by_turn, 3, figsize=(15, 4.2 * (1 + by_turn)), squeeze=False)
    for results, label in loaded:
        x, rows = _points(results)
        metrics = VOICE if x == "sessions" else CHAT
        for ax, (key, _) in zip(axes[0], metrics):
            ax.plot([r[x] for r in rows], [_value(r, key) for r in rows], marker="o", label=label)
        if by_turn:
            plot_turns(axes[1][0], axes[1][1], rows, f"{label}, ")
    if by_turn:
        axes[1][2].set_visible(False)
    axes = axes[0]
    for ax, (_, name) in zip(axes, metrics):
        ax.set_xlabel(x)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if x == "sessions":
        axes[0].set_yscale("log")  # a front end that falls behind does so by orders of magnitude
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
