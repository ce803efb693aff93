"""Throughput of a server with 1 vs N Talker + Code2Wav replicas at a fixed concurrency.

For each replica count it starts `omnirt serve` (a real server process; the speech stages as
worker processes when N > 1), warms it up, then keeps `--concurrency` streaming chat requests in
flight until `--requests` have finished. StageOutput length is pinned (thinker `max_tokens`, talker
`min_tokens` = `max_tokens`) so that runs compare. Prints one JSON line per replica count:
req/s, audio seconds generated per wall second, mean/p90 time to first audio packet (TTFP).

    .venv/bin/python -m omnirt.loadtest.replica_bench --replicas 1 1p 2 --concurrency 4 --requests 24
Other `omnirt serve` flags pass through (e.g. `--model PATH --load-format dummy --deploy-config ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from omnirt.app.audio.wire import PCM16
from omnirt.loadtest.local_server import ROOT

SAMPLES_PER_FRAME = 1920


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(replicas: str, threads: int, first_device: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`replicas`: "2" = two worker processes per speech stage; "1" = in-process; "1p" = one worker process.
    Replicas take devices first_device, first_device + 1, ... (off device 0: a worker process)."""
    n = int(replicas.rstrip("p"))
    first = max(first_device, 1 if replicas.endswith("p") else 0)
    pool = {"num_replicas": n, "devices": ",".join(str(first + i) for i in range(n))}
    port = free_port()
    cmd = [sys.executable, "-m", "omnirt.app.cli", "serve", "--model", "tiny", "--served-model-name", "tiny", "--port",
           str(port), "--threads",
           str(threads), "--log-level", "warning", "--stage-overrides", json.dumps({"1": pool, "2": pool}), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


async def one_request(client: httpx.AsyncClient, url: str, i: int, talker_tokens: int) -> tuple[float, float, int]:
    """Returns (TTFP s, total s, audio samples)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "max_tokens": 8, "talker_sampling": {"max_tokens": talker_tokens, "min_tokens": talker_tokens}}
    t0, ttfp, samples = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            audio = (chunk.get("choices") or [{}])[0].get("delta", {}).get("audio") or {}
            if audio.get("data"):
                ttfp = ttfp if ttfp is not None else time.perf_counter() - t0
                samples += len(audio["data"]) * 3 // 4 // 2
    return ttfp or float("nan"), time.perf_counter() - t0, samples


async def load(url: str, concurrency: int, num_requests: int, talker_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one_request(client, url, -i, talker_tokens) for i in range(2)))  # warm-up
        counter, results = iter(range(num_requests)), []

        async def worker():
            for i in counter:
                results.append(await one_request(client, url, i, talker_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfps = sorted(r[0] for r in results)
    audio_s = sum(r[2] for r in results) / PCM16.sample_rate
    return {"requests": num_requests, "concurrency": concurrency, "wall_s": round(wall, 2),
            "req_per_s": round(num_requests / wall, 3), "audio_s_per_s": round(audio_s / wall, 2),
            "ttfp_mean_s": round(statistics.mean(ttfps), 3), "ttfp_p90_s": round(ttfps[int(0.9 * (len(ttfps) - 1))], 3),
            "latency_mean_s": round(statistics.mean(r[1] for r in results), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", nargs="+", default=["1", "1p", "2"],
                   help='speech replicas per run: "1" in-process, "1p" one worker process, "2" two workers')
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--talker-tokens", type=int, default=60, help="codec frames per request (80 ms each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--first-device", type=int, default=0, help="e.g. 1 on a GPU host: speech replicas on GPUs 1, 2")
    args, extra = p.parse_known_args()
    for n in args.replicas:
        proc, url = start_server(n, args.threads, args.first_device, extra)
        try:
            stats = asyncio.run(load(url, args.concurrency, args.requests, args.talker_tokens))
            replicas = httpx.get(f"{url}/health", timeout=10).json()["replicas"]
            stats["steps"] = {stage: sum(r["steps"] for r in rs) for stage, rs in replicas.items()}
            print(json.dumps({"speech_replicas": n, **stats}), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
