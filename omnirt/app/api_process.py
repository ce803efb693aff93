"""One API process: its port, bound before the model loads; its FastAPI app, built from the flags; uvicorn
serving it until it has drained. `omnirt serve` runs one (`omnirt.app.cli`); `--api-workers N` runs N of them in
front of one engine core (`omnirt.app.workers`)."""

from __future__ import annotations

import argparse
import errno
import faulthandler
import re
import signal
import socket
import sys

import uvicorn
from fastapi import FastAPI

from omnirt.app.images import ImageLimits
from omnirt.app.ops.lifecycle import DrainingServer
from omnirt.app.ops.worker_link import WorkerContext
from omnirt.app.realtime.session import RealtimeLimits
from omnirt.app.server import create_app
from omnirt.app.state import ServerSettings, app_state
from omnirt.app.transports import ws_protocol
from omnirt.app.transports.ice import IceSettings
from omnirt.pipeline.api import EngineClient, EngineInfo


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
        sys.exit(_bind_error(host, port, exc))
    if backlog is not None:
        sock.listen(backlog)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"omnirt: --host {host} is not an address of this machine ({exc.strerror}); give one of its "
                "addresses, or 0.0.0.0 for every interface")
    why = "is in use (another server?)" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
    return f"omnirt: port {port} on {host} {why}; pick another with --port (make serve: PORT=)"


def build_app(args: argparse.Namespace, engine: EngineClient, info: EngineInfo,
              worker: WorkerContext | None = None) -> FastAPI:
    """The FastAPI app over `engine`, with the settings the flags and the engine's profile (`info`) give
    (`worker`: one of `--api-workers`)."""
    return create_app(engine, server_settings(args, info), worker)


def serve(app: FastAPI, args: argparse.Namespace, sock: socket.socket, engine: EngineClient,
          ready_line: str | None = None, server_class: type[DrainingServer] = DrainingServer) -> None:
    """Serve `app` on `sock` until told to stop (SIGTERM, SIGINT) and drained; then stop the engine.
    `kill -USR1 PID` prints every thread's stack to stderr, `kill -HUP PID` re-reads the keys file."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    st = app_state(app)
    signal.signal(signal.SIGHUP, lambda *_: st.keys.reload())
    if ready_line is not None:  # printed once the signals are ours: a SIGHUP after it re-reads the keys
        print(ready_line, flush=True)
    try:
        config = _uvicorn_config(app, args, sock.getsockname()[1])
        server_class(config, st.lifecycle, on_stopped=engine.stop).run(sockets=[sock])
    finally:
        engine.stop()


def server_settings(args: argparse.Namespace, info: EngineInfo) -> ServerSettings:
    """The flags' settings, with the profile's system prompt and front-end load limits."""
    limits = RealtimeLimits(args.realtime_max_sessions, args.realtime_max_event_bytes,
                            args.realtime_max_input_buffer_s, args.realtime_idle_timeout_s,
                            max_audio_rate=args.realtime_max_audio_rate, audio_burst_s=args.realtime_audio_burst_s,
                            send_timeout_s=args.slow_client_timeout)
    ice = IceSettings(_ice_addresses(args), args.webrtc_advertise_address, args.webrtc_ice_servers or ())
    return ServerSettings(
        model_names=(args.served_model_name or args.model,), system_prompt=info.system_prompt,
        max_body_bytes=args.max_body_bytes, max_audio_s=args.max_audio_seconds, api_keys=tuple(args.api_key),
        images=ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images),
        api_keys_file=args.api_keys_file, demo_key_id=args.demo_key_id,
        cors_origins=_listed(args.cors_origins), allowed_hosts=(*_listed(args.allowed_hosts), args.host),
        slow_client_timeout_s=args.slow_client_timeout, shutdown_timeout_s=args.shutdown_timeout,
        realtime=limits, ice=ice, webrtc_connect_timeout_s=args.webrtc_connect_timeout_s,
        webrtc_max_input_lag_s=args.webrtc_max_input_lag_s, front_end=info.front_end)


def _listed(text: str) -> tuple[str, ...]:
    """A flag's comma- or space-separated list."""
    return tuple(re.split(r"[,\s]+", text.strip())) if text.strip() else ()


def _uvicorn_config(app: FastAPI, args: argparse.Namespace, port: int) -> uvicorn.Config:
    limits = app_state(app).settings.realtime
    # frames a bit over the realtime event limit still arrive, so that they get an `error` event. The asyncio loop
    # whether or not uvloop is installed: aiortc's ICE fails on uvloop (encode/uvicorn#840); HTTP is parsed by
    # httptools (a dependency) where uvicorn finds it. WebSocket frames go uncompressed: a microphone's 50 appends a
    # second would each cost ~10 µs of inflating (a tenth of what the front end spends on a chunk) to save a third
    # of the bytes of base64 audio. WebSocket reading is uvicorn's, made cheaper per message
    # (`omnirt.app.transports.ws_protocol`)
    return uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level, loop="asyncio",
                          ws=ws_protocol.PROTOCOL or "auto",
                          ws_max_size=limits.max_event_bytes + 2**20, ws_per_message_deflate=False,
                          timeout_graceful_shutdown=args.shutdown_timeout + 5)


def _ice_addresses(args: argparse.Namespace) -> tuple[str, ...]:
    """The addresses WebRTC gathers on: given ones, else the one the server listens on (127.0.0.1 by default)."""
    if args.ice_addresses:
        return tuple(args.ice_addresses)
    return () if args.host in ("0.0.0.0", "::", "") else (socket.gethostbyname(args.host),)
