"""The GPU's use over a bench point, sampled from nvidia-smi once a second in a thread (None where there is none)."""

from __future__ import annotations

import shutil
import subprocess
import threading


class GpuUse:
    """`with GpuUse() as g: ...` then `g.mean_pct()`: the mean utilisation (all GPUs averaged) while inside."""

    def __init__(self, period_s: float = 1.0):
        self.period_s, self.samples = period_s, []
        self._stop, self._thread = threading.Event(), None

    def __enter__(self) -> GpuUse:
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                self.samples.append(sum(map(float, out)) / len(out))
            except (OSError, ValueError, ZeroDivisionError, subprocess.TimeoutExpired):
                return

    def mean_pct(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
