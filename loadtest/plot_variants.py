"""Bar chart of Code2Wav variants' speed-up on eager per shape, from `c2w_variants.py` output (JSON lines).

    python -m loadtest.plot_variants OUT.png FILE.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.plot_steps import grouped_bars  # noqa: E402


def main(out: str, path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    shapes = list(dict.fromkeys(f"{r['batch']}x{r['frames']}" for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    speedup = {(r["variant"], f"{r['batch']}x{r['frames']}"): r["speedup"] for r in rows}
    fig, ax = plt.subplots(figsize=(7, 3.8))
    grouped_bars(ax, [f"batch {s.replace('x', ', ')} frames" for s in shapes],
                 {name: [speedup.get((name, s), 0) for s in shapes] for name in variants}, labels=True)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("speed-up on eager (ms per decode call)")
    ax.set_title("Code2Wav, one H200, bf16")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
