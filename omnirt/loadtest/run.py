"""`make loadtest`: start a server on a free loopback port, run Locust headless against it (bounded users
and time), write CSV + HTML + raw samples into a run folder (bench-results/loadtest-<date>-<time>/, which
git ignores), stop the server. The committed report in docs/loadtest/ is refreshed only on purpose:
`make loadtest LOADTEST_OUT=docs/loadtest`.

    python -m omnirt.loadtest.run --users 8 --spawn-rate 4 --run-time 60s [--server-arg=--api-key ...]
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

from omnirt.loadtest.local_server import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omnirt.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
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


def build_parser() -> argparse.ArgumentParser:
    from omnirt.app.flags import HelpFormatter

    class Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="make loadtest", description=__doc__, formatter_class=Formatter)
    p.add_argument("--users", type=int, default=8, help="concurrent Locust users")
    p.add_argument("--spawn-rate", type=float, default=4, help="users started per second")
    p.add_argument("--run-time", default="60s", help="how long the load runs")
    p.add_argument("--out", default=None, help="report folder, relative to the repository (default: "
                   "bench-results/loadtest-<date>-<time>/)")
    p.add_argument("--name", default="omnirt", help="the report files' prefix")
    p.add_argument("--server-arg", action="append", default=[], help="extra `omnirt serve` argument (repeatable; "
                   "default: none)")
    p.add_argument("user_classes", nargs="*", help="Locust user classes (default: all)")
    return p


def main() -> None:
    args = build_parser().parse_args()
    out = ROOT / (args.out or f"bench-results/loadtest-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(port, ["--threads", os.environ.get("OMNIRT_THREADS", "2"), *args.server_arg],
                          out / f"{args.name}_server.log")
    try:
        prefix = str(out / args.name)
        rc = subprocess.call([sys.executable, "-m", "locust", "-f", str(Path(__file__).with_name("locustfile.py")),
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
