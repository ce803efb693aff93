"""`make loadtest`: start a server on a free loopback port, run Locust headless against it (bounded users
and time), write CSV + HTML + raw samples under docs/loadtest/, stop the server.

    python -m loadtest.run --users 8 --spawn-rate 4 --run-time 60s [--server-arg=--api-key ...]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--spawn-rate", type=float, default=4)
    p.add_argument("--run-time", default="60s")
    p.add_argument("--out", default="docs/loadtest")
    p.add_argument("--name", default="omnirt")
    p.add_argument("--server-arg", action="append", default=[], help="extra `omnirt serve` argument (repeatable)")
    p.add_argument("user_classes", nargs="*", help="Locust user classes (default: all)")
    args = p.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(port, ["--threads", os.environ.get("OMNIRT_THREADS", "2"), *args.server_arg],
                          out / f"{args.name}_server.log")
    try:
        prefix = str(out / args.name)
        rc = subprocess.call([sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
                              "--headless", "--host", f"http://127.0.0.1:{port}", "-u", str(args.users),
                              "-r", str(args.spawn_rate), "-t", args.run_time, "--stop-timeout", "30",
                              "--csv", prefix, "--html", f"{prefix}_report.html", "--raw-samples", prefix,
                              "--only-summary", *args.user_classes], cwd=ROOT)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"results: {prefix}_stats.csv, {prefix}_report.html, {prefix}_summary.json")
    sys.exit(rc)


if __name__ == "__main__":
    main()
