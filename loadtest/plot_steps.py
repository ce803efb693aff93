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


def main(out: str, path: str) -> None:
    runs = parse(Path(path).read_text())
    stages = sorted({s for r in runs.values() for b in r.values() for s in b})
    batches = sorted({b for r in runs.values() for b in r})
    fig, axes = plt.subplots(1, len(stages), figsize=(4.5 * len(stages), 3.8))
    width = 0.8 / len(runs)
    for ax, stage in zip(axes, stages):
        for i, (name, run) in enumerate(runs.items()):
            xs = [j + i * width for j in range(len(batches))]
            ax.bar(xs, [run.get(b, {}).get(stage, 0) for b in batches], width, label=name)
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(batches))], [f"b={b}" for b in batches])
        ax.set_title(f"{stage} decode step")
        ax.set_ylabel("ms (captured graph replay)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
