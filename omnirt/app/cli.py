"""`omnirt serve`: build the engine from a deploy profile and serve it over HTTP.

Start-up fails fast, in this order, before anything slow: the flags (argparse), the deploy profile
as the engine will read it on every platform (no torch import), the keys file, the port (bound here,
before the model loads). Each error names the flag or key, the file and line where there is one, and
what is accepted; then the engine loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from omnirt.app.flags import build_parser
from omnirt.app.ops.keys import KeyRing, KeysFileError
from omnirt.app.ops.logs import setup as setup_logs
from omnirt.pipeline.api import EngineOptions, EngineStartError, check_options, start_engine

log = logging.getLogger(__name__)
# --api-workers auto: each worker's event loop and VAD thread take one to two cores under load, and the engine
# core's stage threads (and their host-side work) need several more: a quarter of the cores goes to workers
CORES_PER_API_WORKER = 4
MAX_AUTO_API_WORKERS = 8  # past this, one engine core and the shared limits' round trips bound what more add
# what the `loadtest` extra (pyproject.toml) installs, by import name: `omnirt bench` needs them
# what `omnirt bench` and `omnirt bench realtime` import from the loadtest extra (Locust and websocket-client
# serve `make loadtest` only, so a GPU host without them still runs the benches)
LOADTEST_MODULES = ("aiohttp", "httpx", "matplotlib", "soundfile")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's flags as plain values: they cross to the engine core process."""
    return EngineOptions(
        model=args.model, deploy_config=str(args.deploy_config) if args.deploy_config else None,
        load_format=args.load_format, dtype=args.dtype, stage_overrides=dict(args.stage_overrides),
        settings=tuple(args.settings), enforce_eager=args.enforce_eager,
        platform=args.platform, distributed=args.distributed, threads=args.threads,
        max_output_buffer_bytes=args.max_output_buffer_bytes, process=args.engine_process,
        gpu_memory_utilization=args.gpu_memory_utilization, step_log=args.step_log,
        log_level=args.log_level, log_format=args.log_format)


def serve(args: argparse.Namespace) -> None:
    opts = engine_options(args)
    try:
        check_options(opts)  # a bad profile or flag stops here, before torch is imported
    except EngineStartError as exc:
        sys.exit(f"omnirt: {exc}")
    _check_keys(args)
    if args.api_workers == "auto":
        args.api_workers = auto_api_workers(args.engine_process)
    if args.api_workers > 1 and args.engine_process == "inproc":
        sys.exit("omnirt: --api-workers needs the engine core in a process of its own (--engine-process auto or "
                 "core), not inproc")
    # deferred for start-up cost: FastAPI, scipy.signal and the routes (~1.5 s) load once the flags are good
    from omnirt.app import api_process, workers

    if args.api_workers > 1:
        # the port is held from here (bound, not listening): a port in use stops here, before the model loads
        sock = api_process.listen(args.host, args.port, reuse_port=True, backlog=None)
        sys.exit(workers.supervise(args, opts, sock, lambda info: ready_line(args, sock.getsockname()[1], info)))
    sock = api_process.listen(args.host, args.port)  # a port in use stops here, before the model loads
    try:
        engine = start_engine(opts, log_setup=setup_logs)
    except EngineStartError as exc:
        sys.exit(f"omnirt: {exc}")
    info = engine.info()
    app = api_process.build_app(args, engine, info)
    api_process.serve(app, args, sock, engine, ready_line(args, sock.getsockname()[1], info))
    health = engine.health()
    if not health.is_alive:
        sys.exit(f"omnirt: {health.reason}")


def auto_api_workers(engine_process: str) -> int:
    """`--api-workers auto`: a worker per CORES_PER_API_WORKER cores, at most MAX_AUTO_API_WORKERS; one where
    workers cannot help (the engine in the API process, no SO_REUSEPORT spreading). Logged."""
    cores = host_cores()
    if engine_process == "inproc" or not sys.platform.startswith("linux"):
        count, why = 1, "the engine runs in the API process" if engine_process == "inproc" else "not Linux"
    else:
        count = max(1, min(MAX_AUTO_API_WORKERS, cores // CORES_PER_API_WORKER))
        why = f"{cores} cores / {CORES_PER_API_WORKER}, at least 1, at most {MAX_AUTO_API_WORKERS}"
    log.info("--api-workers auto: %d API worker%s (%s)", count, "s" if count > 1 else "", why)
    return count


def host_cores() -> int:
    """The cores this process may use: its CPU affinity, within a cgroup v2 CPU quota (a container's --cpus)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return cores if quota == "max" else max(1, min(cores, int(quota) // int(period)))
    except (OSError, ValueError):
        return cores


def ready_line(args: argparse.Namespace, port: int, info) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    keyed = bool(args.api_key) or args.api_keys_file is not None
    workers = f", {args.api_workers} API workers" if args.api_workers > 1 else ""
    return (f"omnirt ready: http://{host}:{port}/  (model {args.served_model_name or args.model!r} on "
            f"{info.platform}, voices {', '.join(info.voices)}{workers}{', API key required' if keyed else ''})")


def _check_keys(args: argparse.Namespace) -> None:
    """A keys file that cannot be used, or a demo key that is not in it, stops the server before the engine starts."""
    try:
        keys = KeyRing(tuple(args.api_key), args.api_keys_file)
    except KeysFileError as exc:
        sys.exit(f"omnirt: {exc}")
    if args.demo_key_id is not None and keys.get(args.demo_key_id) is None:
        sys.exit(f"omnirt: --demo-key-id {args.demo_key_id!r} is not the id of a key (--api-key keys are cli-1, "
                 "cli-2, ...; the keys file's have their own)")


def _check_loadtest_extra() -> None:
    """`omnirt bench` without the `loadtest` extra stops with what to install, not an import traceback."""
    missing = [m for m in LOADTEST_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"omnirt bench needs the loadtest extra ({', '.join(missing)} not installed): "
                 "pip install 'omnirt[loadtest]'")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark clients are programs of their own; omnirt/app/ never imports them
        _check_loadtest_extra()
        realtime = argv[1:2] == ["realtime"]
        module = "omnirt.loadtest.realtime_bench" if realtime else "omnirt.loadtest.bench"
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1 + realtime:]])
    args = build_parser().parse_args(argv)
    setup_logs(args.log_level, args.log_format)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
