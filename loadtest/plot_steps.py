"""Bar chart of captured decode-step times per stage and batch, from `diag.py` output (`DIAG_STEPS=1`).

    python -m loadtest.plot_steps OUT.png FILE.txt

Each `step b=N: thinker X ms, talker Y ms, predictor Z ms` line is one batch of one run; the runs of a
file are told apart by the `NAME rc=` line that ends each (diag.sh prints it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEP = re.compile(r"^step b=(\d+): (.*)$")
TIME = re.compile(r"(\w+) ([\d.]+) ms")
END = re.compile(r"^(\S+) rc=")


def parse(text: str) -> dict[str, dict[int, dict[str, float]]]:
    """run name -> batch -> stage -> ms."""
    runs, current = {}, {}
    for line in text.splitlines():
        if m := STEP.match(line):
            current[int(m[1])] = {k: float(v) for k, v in TIME.findall(m[2])}
        elif (m := END.match(line)) and current:
            runs[m[1]], current = current, {}
    return runs


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], labels: bool = False) -> None:
    """One bar per series in each group, side by side, the group's name under them (values above with labels)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar([j + i * width for j in range(len(groups))], values, width, label=name)
        if labels:
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups)
    ax.legend()


def main(out: str, path: str) -> None:
    runs = parse(Path(path).read_text())
    stages = sorted({s for r in runs.values() for b in r.values() for s in b})
    batches = sorted({b for r in runs.values() for b in r})
    fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.8))
    for ax, stage in zip(axes, stages):
        grouped_bars(ax, [f"b={b}" for b in batches],
                     {name: [run.get(b, {}).get(stage, 0) for b in batches] for name, run in runs.items()})
        ax.set_title(f"{stage} decode step")
        ax.set_ylabel("ms (captured graph replay)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
