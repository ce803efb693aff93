"""`omnirt serve` of a named variant (`omnirt/loadtest/variants.py`), started here for one benchmark and stopped after
it.

The server runs from a checkout (this one by default; another build's tree to compare builds) on a free port,
with its log in a file; it is ready when `/health` answers and every API worker has started.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omnirt.loadtest.variants import serve_args

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds the omnirt package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict | None:
    """The server's /health, or None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return json.loads(r.read())
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


class LocalServer:
    """`omnirt serve ARGS VARIANT-ARGS MORE` from `src` on a free port; `url` once started."""

    def __init__(self, variant: str, args: list[str], more: list[str] = (), src: Path | str = ROOT,
                 log: Path | None = None, env: dict[str, str] | None = None, python: str = sys.executable):
        self.variant, self.src = variant, Path(src).resolve()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the variant's arguments last: they are the point (its settings win over any given)
        self.cmd = [python, "-m", "omnirt.app.cli", "serve", *args, *more, *serve_args(variant),
                    "--port", str(self.port)]
        self.log = log or Path(f"/tmp/omnirt-serve-{variant}-{self.port}.log")
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, limit_s: float = 600) -> float:
        """Start, wait until ready; returns the seconds it took. Raises RuntimeError if it dies or is late."""
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=self.src, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        while not self.is_ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.variant} exited {self.proc.returncode}: {self.tail()}")
            if time.monotonic() - t0 > limit_s:
                self.stop()
                raise RuntimeError(f"server {self.variant} not ready in {limit_s:.0f} s: {self.tail()}")
            time.sleep(1)
        return time.monotonic() - t0

    def is_ready(self) -> bool:
        h = health(self.url)
        return h is not None and all(w.get("pid") is not None for w in h.get("api_workers", []))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # SIGTERM: the server drains, then stops its engine core and workers
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def add_args(p) -> None:
    """The benches' flags for a server of their own."""
    p.add_argument("--serve", metavar="VARIANT", help="start `omnirt serve` of this variant (omnirt/loadtest/"
                   "variants.py: profile, reference, no-async-chunk, ...; joined by +) on a free port for this "
                   "run, and stop it after; --url is then ignored")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help="more `omnirt serve` arguments for --serve, one string (e.g. \"--threads 1\")")
    p.add_argument("--serve-from", default=str(ROOT), metavar="DIR",
                   help="the checkout --serve runs the server from (another build's tree to compare builds)")


@contextmanager
def serving(args) -> Iterator[None]:
    """A bench's run, inside the server its `--serve` asks for (with the bench's model; `args.url` then points at
    it); without --serve, against --url. A dry run says what it would start, and stops there."""
    if not args.serve:
        yield
        return
    server = LocalServer(args.serve, ["--model", args.model, "--log-level", "warning"], shlex.split(args.serve_args),
                         src=args.serve_from)
    args.url = server.url
    print(f"{'would start' if args.dry_run else 'starting'}: omnirt {shlex.join(server.cmd[4:])} (log {server.log})",
          flush=True)
    if args.dry_run:
        raise SystemExit(0)
    with server:
        yield
