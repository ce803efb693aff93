"""What every Triton kernel of the engine shares: whether Triton imports, and the interpreter's lock.

On the CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is
imported), which keeps the running grid in globals: stage threads take turns under `INTERPRETER`, one
lock for every kernel (the attention and the MoE kernels of two stages may otherwise interleave).
Compiled kernels need no lock.
"""

from __future__ import annotations

import contextlib
import os
import threading

INTERPRETER = threading.Lock() if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()


def available() -> bool:
    """Triton imports (it compiles for the device, or interprets on the CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
