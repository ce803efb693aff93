"""Plot the single-H200 ablation beside vLLM-Omni's published three-GPU steps.

    python -m loadtest.plot_h200 docs/benchmarks/h200-ablation [LABEL=NAME ...]

reads the `omnirt bench` JSON files NAME.json of that folder (one server per variant, prompt 160; by default
the variants of the first ablation) and writes `h200-ablation.png` there: req/s, mean audio TTFP and mean RTF
at concurrency 64, one bar per variant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# one server per variant, each with one layer switched off (not cumulative like the blog's steps)
VARIANTS = [("no CUDA graphs", "h200-eager"), ("no async chunk", "h200-no-async-chunk"),
            ("no async output", "h200-no-async-output"), ("all on", "h200-graphs")]
METRICS = [("req_per_s", "requests / s"), ("ttfp_mean_ms", "mean audio TTFP (ms)"), ("rtf_mean", "mean RTF")]
PUBLISHED = (11.7, 632, 0.47)  # vLLM-Omni's blog, 3 GPUs, c=64, every layer on
TARGET = (20, 300, 0.28)  # issue 7, one H200


def at_concurrency(path: Path, c: int) -> dict:
    return next(r for r in json.loads(path.read_text())["results"] if r["concurrency"] == c)


def main(folder: str, variants: list[tuple[str, str]] = VARIANTS) -> None:
    root = Path(folder)
    ours = [at_concurrency(root / f"{name}.json", 64) for _, name in variants]
    fig, axes = plt.subplots(1, 3, figsize=(max(15, 2.6 * len(variants)), 4.2))
    for i, (ax, (key, label)) in enumerate(zip(axes, METRICS)):
        ax.bar([v[0] for v in variants], [r[key] for r in ours], color="tab:blue", label="omnirt, one H200")
        ax.axhline(PUBLISHED[i], color="tab:orange", ls="--", label="vLLM-Omni, 3 GPUs (published)")
        ax.axhline(TARGET[i], color="tab:green", ls=":", label="target")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=8, labelrotation=25)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)  # clear of the bars
    fig.suptitle("Qwen3-Omni-30B-A3B, concurrency 64, 11.6 s of audio per reply: one layer off at a time")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(root / "h200-ablation.png", dpi=110)


if __name__ == "__main__":
    given = [tuple(arg.split("=", 1)) for arg in sys.argv[2:]]
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks/h200-ablation", given or VARIANTS)
