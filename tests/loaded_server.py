"""Test-only: `python -m tests.loaded_server serve ...` is `omnirt serve` (one API process) whose event loop a
SIGUSR2 loads and the next SIGUSR2 frees: while loaded, a callback holds the loop `HOLD_S` at a time with
`GAP_S` between, so the loop still serves every connection, only late, as a front end past its capacity does.
The load is put on from outside, deterministically (no race against the machine's own speed); nothing in omnirt/app/
knows about it."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

from omnirt.app.cli import main

HOLD_S, GAP_S = 0.6, 0.02
_is_loaded = False


def _hold(loop: asyncio.AbstractEventLoop) -> None:
    if _is_loaded:
        time.sleep(HOLD_S)
        loop.call_later(GAP_S, _hold, loop)


def _toggle(*_) -> None:
    """Runs on the main thread, the event loop's: the loop is the running one."""
    global _is_loaded
    _is_loaded = not _is_loaded
    if _is_loaded:
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(_hold, loop)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR2, _toggle)
    main(sys.argv[1:])
