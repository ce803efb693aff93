"""`omnirt serve`: build the engine from a deploy profile and serve it over HTTP.

Start-up fails fast, in this order, before anything slow: the flags (argparse), the deploy profile
as the engine will read it on every platform (no torch import), the keys file, the port (bound here,
before the model loads). Each error names the flag or key, the file and line where there is one, and
what is accepted; then the engine loads.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from app.flags import build_parser
from app.transports.ice import IceSettings
from pipeline.api import EngineOptions, EngineStartError, check_options, start_engine

if TYPE_CHECKING:
    from app.server import ServerSettings


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
    if args.api_workers > 1:
        from app.ops.workers import supervise

        if args.engine_process == "inproc":
            sys.exit("omnirt: --api-workers needs the engine core in a process of its own (--engine-process auto "
                     "or core), not inproc")

        # the port is held from here (bound, not listening): a port in use stops here, before the model loads
        sock = listen(args.host, args.port, reuse_port=True, backlog=None)
        sys.exit(supervise(args, opts, sock, lambda info: ready_line(args, sock.getsockname()[1], info)))
    sock = listen(args.host, args.port)  # a port in use stops here, before the model loads
    from app.ops.logs import setup

    try:
        engine = start_engine(opts, log_setup=setup)
    except EngineStartError as exc:
        sys.exit(f"omnirt: {exc}")
    _serve_one(args, engine, sock)


def _serve_one(args: argparse.Namespace, engine, sock: socket.socket) -> None:
    """One API process (it owns the engine core) on `sock` until told to stop."""
    from app.ops.lifecycle import DrainingServer
    from app.server import create_app

    info = engine.info()
    app = create_app(engine, server_settings(args, info.system_prompt))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    signal.signal(signal.SIGHUP, lambda *_: app.state.keys.reload())  # `kill -HUP PID`: re-read the keys file
    port = sock.getsockname()[1]
    print(ready_line(args, port, info), flush=True)
    try:
        DrainingServer(uvicorn_config(app, args, port), app.state.server.lifecycle,
                       on_stopped=engine.stop).run(sockets=[sock])
    finally:
        engine.stop()
    health = engine.health()
    if not health.is_alive:
        sys.exit(f"omnirt: {health.reason}")


def uvicorn_config(app, args: argparse.Namespace, port: int):
    import uvicorn

    limits = app.state.server.settings.realtime
    # frames a bit over the realtime event limit still arrive, so that they get an `error` event. The asyncio loop
    # whether or not uvloop is installed: aiortc's ICE fails on uvloop (encode/uvicorn#840); HTTP is parsed by
    # httptools (a dependency) where uvicorn finds it
    return uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level, loop="asyncio",
                          ws_max_size=limits.max_event_bytes + 2**20,
                          timeout_graceful_shutdown=args.shutdown_timeout + 5)


def ready_line(args: argparse.Namespace, port: int, info) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    keyed = bool(args.api_key) or args.api_keys_file is not None
    workers = f", {args.api_workers} API workers" if args.api_workers > 1 else ""
    return (f"omnirt ready: http://{host}:{port}/  (model {args.served_model_name or args.model!r} on "
            f"{info.platform}, voices {', '.join(info.voices)}{workers}{', API key required' if keyed else ''})")


def server_settings(args: argparse.Namespace, system_prompt: str | None) -> ServerSettings:
    from app.images import ImageLimits
    from app.realtime.session import RealtimeLimits
    from app.server import ServerSettings

    limits = RealtimeLimits(args.realtime_max_sessions, args.realtime_max_event_bytes,
                            args.realtime_max_input_buffer_s, args.realtime_idle_timeout_s,
                            max_audio_rate=args.realtime_max_audio_rate, audio_burst_s=args.realtime_audio_burst_s,
                            send_timeout_s=args.slow_client_timeout)
    ice = IceSettings(_ice_addresses(args), args.webrtc_advertise_address, args.webrtc_ice_servers or ())
    return ServerSettings(
        model_names=(args.served_model_name or args.model,), system_prompt=system_prompt,
        max_body_bytes=args.max_body_bytes, max_audio_s=args.max_audio_seconds, api_keys=tuple(args.api_key),
        images=ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images),
        api_keys_file=args.api_keys_file, demo_key_id=args.demo_key_id,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        slow_client_timeout_s=args.slow_client_timeout, shutdown_timeout_s=args.shutdown_timeout,
        realtime=limits, ice=ice, webrtc_connect_timeout_s=args.webrtc_connect_timeout_s,
        webrtc_max_input_lag_s=args.webrtc_max_input_lag_s)


def listen(host: str, port: int, reuse_port: bool = False, backlog: int | None = 2048) -> socket.socket:
    """The server's socket, bound now (uvicorn serves on it), or exit saying why not. `reuse_port`: shared
    with the other `--api-workers` (SO_REUSEPORT); `backlog` None: bound only, holding the port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        sys.exit(f"omnirt: --host {host!r} is not an address of this machine ({exc.strerror})")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "is in use (another server?)" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        sys.exit(f"omnirt: port {port} on {host} {why}; pick another with --port (make serve: PORT=)")
    if backlog is not None:
        sock.listen(backlog)
    return sock


def _check_keys(args: argparse.Namespace) -> None:
    """A keys file that cannot be used, or a demo key that is not in it, stops the server before the engine starts."""
    from app.ops.keys import KeyRing, KeysFileError

    try:
        keys = KeyRing(tuple(args.api_key), args.api_keys_file)
    except KeysFileError as exc:
        sys.exit(f"omnirt: {exc}")
    if args.demo_key_id is not None and keys.get(args.demo_key_id) is None:
        sys.exit(f"omnirt: --demo-key-id {args.demo_key_id!r} is not the id of a key (--api-key keys are cli-1, "
                 "cli-2, ...; the keys file's have their own)")


def _ice_addresses(args: argparse.Namespace) -> tuple[str, ...]:
    """The addresses WebRTC gathers on: given ones, else the one the server listens on (127.0.0.1 by default)."""
    if args.ice_addresses:
        return tuple(args.ice_addresses)
    return () if args.host in ("0.0.0.0", "::", "") else (socket.gethostbyname(args.host),)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark clients are programs of their own; app/ never imports them
        realtime = argv[1:2] == ["realtime"]
        module = "loadtest.realtime_bench" if realtime else "loadtest.bench"
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1 + realtime:]])
    args = build_parser().parse_args(argv)
    from app.ops.logs import setup

    setup(args.log_level, args.log_format)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
