"""Plot the single-H200 figures in docs/benchmarks/h200-2026-11-29.json (eager vs CUDA graphs)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

data = json.loads(Path("docs/benchmarks/h200-2026-11-29.json").read_text())
runs = [r for r in data["runs"] if "error" not in r]
fig, axes = plt.subplots(1, 3, figsize=(14, 4))
for variant in dict.fromkeys(r["variant"] for r in runs):
    pts = [r for r in runs if r["variant"] == variant]
    c = [r["concurrency"] for r in pts]
    axes[0].plot(c, [r["req_per_s"] for r in pts], "o-", label=variant)
    axes[1].plot(c, [r.get("ttfp_s", r.get("ttfp_mean_s")) for r in pts], "o-", label=variant)
    axes[2].plot(c, [r.get("rtf", r.get("rtf_mean")) for r in pts], "o-", label=variant)
for ax, label in zip(axes, ("requests / s", "mean audio TTFP (s)", "mean RTF")):
    ax.set_xlabel("concurrency")
    ax.set_ylabel(label)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
axes[2].axhline(1.0, color="gray", lw=0.8)
axes[0].legend(fontsize=8)
fig.suptitle("Qwen3-Omni-30B-A3B (dummy weights), one H200: 145 frames (11.6 s) per reply")
fig.tight_layout()
fig.savefig("docs/benchmarks/h200-2026-11-29.png", dpi=110)
