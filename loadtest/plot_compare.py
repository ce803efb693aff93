"""Overlay `omnirt bench` runs of the same sweep: req/s, mean audio TTFP and mean RTF against concurrency.

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

METRICS = [("req_per_s", "requests / s"), ("ttfp_mean_ms", "mean audio TTFP (ms)"), ("rtf_mean", "mean RTF")]


def main(out: str, runs: list[str]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        path, _, label = run.partition("=")
        results = json.loads(Path(path).read_text())["results"]
        rows = sorted((r for r in results if r["prompt_len"] == results[0]["prompt_len"]),
                      key=lambda r: r["concurrency"])
        for ax, (key, _) in zip(axes, METRICS):
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker="o",
                    label=label or Path(path).stem)
    for ax, (_, name) in zip(axes, METRICS):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
