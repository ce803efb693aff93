"""Where a busy process's threads spend their time, from inside it: a thread that samples every other
thread's Python stack at a fixed interval (`sys._current_frames`) and counts, per thread, the functions
on the stack (inclusive) and at its top (self).

For machines where py-spy cannot attach (no ptrace). A thread blocked in C code with the interpreter
lock released (a device wait, a queue get) shows the Python frame that made the call. The sampler needs
the lock to take a sample, so samples land where the sampled thread releases it or at the switch
interval: good for where the time goes, not for microsecond accounting.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter


def _where(frame, line: bool = False) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}" + (f":{frame.f_lineno}" if line else "")


class StackSampler(threading.Thread):
    """Samples threads whose name starts with `prefix` every `interval` seconds until `stop()`."""

    def __init__(self, prefix: str = "omnirt-", interval: float = 0.001):
        super().__init__(name="stack-sampler", daemon=True)
        self.prefix, self.interval = prefix, interval
        self.samples: Counter[str] = Counter()
        self.inclusive: dict[str, Counter[str]] = {}
        self.leaf: dict[str, Counter[str]] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "")
                if name.startswith(self.prefix):
                    self._count(name, frame)
            time.sleep(self.interval)

    def _count(self, name: str, frame) -> None:
        self.samples[name] += 1
        self.leaf.setdefault(name, Counter())[_where(frame, line=True)] += 1
        seen = set()
        while frame is not None:
            seen.add(_where(frame))
            frame = frame.f_back
        self.inclusive.setdefault(name, Counter()).update(seen)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def report(self, top: int = 25) -> str:
        """Per thread: the share of samples each function was on the stack (inclusive) and on top (self)."""
        lines = []
        for name, n in self.samples.most_common():
            lines.append(f"== {name}: {n} samples")
            for label, counts in (("inclusive", self.inclusive[name]), ("self, by line", self.leaf[name])):
                lines.append(f"  -- {label}")
                lines += [f"  {100 * c / n:5.1f}%  {where}" for where, c in counts.most_common(top)]
        return "\n".join(lines)
