"""Where a first packet's time goes: per stage, the seconds from a request's submission to the engine until
that stage's first output for it (the Thinker's first token, the Talker's first frame, Code2Wav's first
PCM), as histogram counts for /metrics. A client's time to first audio is the last stage's figure plus the
API process's own share, so the differences between stages say which one a slow first packet waited on."""

from __future__ import annotations

from bisect import bisect_left

from omnirt.pipeline.types import FIRST_OUTPUT_BUCKETS_S


class FirstOutputTimes:
    """One stage's histogram. Written by the one thread that routes that stage's step results."""

    def __init__(self):
        self.counts = [0] * (len(FIRST_OUTPUT_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(FIRST_OUTPUT_BUCKETS_S, seconds)] += 1  # a bucket holds values <= its bound
        self.sum_s += seconds

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.counts), self.sum_s
