"""What watches a stage's steps (`StepObserver`), kept out of the step loop: the counters behind /metrics, and
`--step-log`'s line per step."""

from __future__ import annotations

import time

from omnirt.pipeline.stage.step import Batch


class StepCounters:
    """A stage's steps for /metrics: how many at each batch size, their seconds (decode steps apart), and how
    many were issued while the one before was still in flight (async scheduling)."""

    def __init__(self, max_num_seqs: int):
        self.batch_size_counts = [0] * (max_num_seqs + 1)  # steps per batch size
        self.busy_s = 0.0  # seconds inside steps (host work + waiting for the device)
        self.decode_busy_s = 0.0  # the part of busy_s in decode steps (the rest: prefill chunks)
        self.num_decode_steps = 0
        self.num_steps_ahead = 0

    @property
    def num_steps(self) -> int:
        return sum(self.batch_size_counts)

    def observe(self, stage: str, batch: Batch | None, elapsed_s: float, overlapped: bool = False) -> None:
        self.busy_s += elapsed_s
        if batch is None:
            return
        self.batch_size_counts[len(batch.requests)] += 1
        self.num_steps_ahead += overlapped
        if not batch.is_prefill:
            self.decode_busy_s += elapsed_s
            self.num_decode_steps += 1

    def close(self) -> None:
        """Counters hold nothing to release."""


class StepLog:
    """`--step-log FILE`: a line per step, appended whole (several stages, and worker processes, share the file):
    wall-clock time, stage, prefill or decode, requests, tokens, milliseconds (with async scheduling, the time
    to issue the step and land the one before)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by `close`, when the stage stops)

    def observe(self, stage: str, batch: Batch | None, elapsed_s: float, overlapped: bool = False) -> None:
        if batch is None:
            return
        kind = "prefill" if batch.is_prefill else "decode"
        self._file.write(f"{time.time():.4f} {stage} {kind} {len(batch.requests)} {sum(batch.num_new_tokens)} "
                         f"{elapsed_s * 1000:.2f}\n")

    def close(self) -> None:
        self._file.close()
