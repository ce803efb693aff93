"""Where first packets wait: one horizontal bar per `omnirt bench` point, cut where each stage gave its first
output (the engine's mean time from submission, `first_output_ms`), then the API process's own time to first
audio, then the client's TTFP.

    python -m loadtest.plot_first_packet OUT.png FILE.json[=LABEL] ...

Segments: the Thinker's first token, the Talker's first frame after it, Code2Wav's first PCM after that, the
API process's share (prompt parsing, the hand-offs to and from the engine core), the HTTP stream to the client.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SEGMENTS = [("thinker", "Thinker: first token"), ("talker", "Talker: first frame"),
            ("code2wav", "Code2Wav: first PCM"), ("api", "API process"), ("client", "HTTP to the client")]


def bars(path: Path, label: str) -> list[tuple[str, list[float]]]:
    """(bar label, segment lengths in ms) for each point of the run that has the stage figures."""
    out = []
    for row in json.loads(path.read_text())["results"]:
        firsts = row.get("first_output_ms") or {}
        if not firsts or row.get("ttfp_mean_ms") is None:
            continue
        ends = [firsts.get(name) for name, _ in SEGMENTS[:-1]] + [row["ttfp_mean_ms"]]
        ends = [e for e in ends if e is not None]
        out.append((f"{label}, c={row['concurrency']}", [b - a for a, b in zip([0.0, *ends], ends)]))
    return out


def main(out: str, runs: list[str]) -> None:
    rows = []
    for arg in runs:
        path, _, label = arg.partition("=")
        rows += bars(Path(path), label or Path(path).stem)
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.6))
    for y, (_, lengths) in enumerate(rows):
        left = 0.0
        for i, width in enumerate(lengths):
            ax.barh(y, width, left=left, color=f"C{i}", label=SEGMENTS[i][1] if y == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("mean ms from the request (client TTFP at the bar's end)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("Where first packets wait")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
