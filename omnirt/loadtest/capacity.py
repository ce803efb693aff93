"""`omnirt bench realtime --capacity`: the most conversing sessions the server carries. The session count doubles
from the first `--sessions` until a point fails, then bisects between the last passing and the first failing count.
A point passes when its p90 response latency (`speech_stopped` -> first audio; the maximum where the point has too
few turns for a p90) is within the bound, and no turn underran, lost its reply (no audio, or no end) or met an
error."""

from __future__ import annotations

from collections.abc import Callable


def failures(row: dict, bound_ms: float) -> list[str]:
    """Why the point `row` fails (empty: it passes)."""
    response = row["response_ms"]
    p90 = response["p90"] if response["p90"] is not None else response["max"]
    why = []
    if p90 is None or p90 > bound_ms:
        why.append(f"p90 response {'-' if p90 is None else f'{p90:.0f}'} ms > {bound_ms:.0f} ms")
    if row.get("underruns"):
        why.append(f"{row['underruns']} underruns")
    lost = row["turns_without_audio"] + max(0, row["expected_turns"] - row["turns"])
    if lost:
        why.append(f"{lost} lost turns")
    if row["errors"]:
        why.append(f"{row['errors']} errors")
    return why


def search(point: Callable[[int], dict], start: int, limit: int, bound_ms: float) -> tuple[list[dict], int]:
    """Run `point(n)` at the counts of the search; (every point's row with its "passed" and "why", the last passing
    count: 0 where even `start` failed)."""
    rows, good, bad = [], 0, None

    def run(n: int) -> bool:
        row = point(n)
        why = failures(row, bound_ms)
        rows.append({**row, "passed": not why, "why": why})
        return not why

    n = start
    while bad is None and n <= limit:
        good, bad = (n, None) if run(n) else (good, n)
        n *= 2
    if bad is None:
        return rows, good
    while bad - good > 1 and good > 0:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if run(mid) else (good, mid)
    return rows, good


def markdown(rows: list[dict], last_passing: int, bound_ms: float) -> str:
    lines = [f"### capacity: {last_passing} sessions (p90 response within {bound_ms:.0f} ms, no underrun, lost turn "
             "or error)\n", "| sessions | passed | why not |", "|---|---|---|"]
    lines += [f"| {r['sessions']} | {'yes' if r['passed'] else 'no'} | {'; '.join(r['why']) or '-'} |" for r in rows]
    return "\n".join(lines) + "\n"
