"""`omnirt serve`: build the engine from a deploy profile and serve it over HTTP."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from pipeline.api import EngineOptions, EngineStartError, start_engine

log = logging.getLogger("omnirt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnirt", description="Realtime voice-agent server for omni models")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the server")
    s.add_argument("--model", default="tiny", help="'tiny' (built in), a local folder, or an HF-cache id")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    s.add_argument("--deploy-config", default=None, help="deploy profile YAML (default: by model)")
    s.add_argument("--load-format", choices=["auto", "dummy"], default=None)
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    s.add_argument("--stage-overrides", default=None, type=json.loads,
                   help='JSON per stage id, e.g. \'{"1": {"max_num_seqs": 8}}\'')
    s.add_argument("--moe-backend", choices=["auto", "grouped_mm", "batched_mm", "eager", "triton"], default=None,
                   help="transformers experts implementation, or triton: fused Triton kernels for decode-sized "
                        "batches (auto: grouped_mm where graphs run)")
    s.add_argument("--attention", choices=["auto", "slots", "dense"], default=None,
                   help="slots: a Triton kernel reads the KV cache in place; dense: a per-layer copy for "
                        "transformers' SDPA (auto: slots where graphs run)")
    s.add_argument("--compile", choices=["auto", "on", "off"], default=None,
                   help="torch.compile the decode steps before their graphs are captured (auto: in the stages "
                        "whose graphs run; off: graphs of the uncompiled steps, an ablation)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs and no compilation in any stage (ablation)")
    s.add_argument("--no-async-chunk", action="store_true",
                   help="hand off whole payloads: Talker after the Thinker, Code2Wav after the Talker (ablation)")
    s.add_argument("--no-async-output", action="store_true",
                   help="stage threads wait for the consumer of each output (ablation)")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="free each request's KV slot when it ends: every turn prefills its whole prompt (ablation)")
    s.add_argument("--engine", choices=["omnirt", "reference"], default="omnirt",
                   help="reference: transformers' own generate(), one request at a time (the baseline)")
    s.add_argument("--engine-process", choices=["auto", "core", "inproc"], default="auto",
                   help="core: the engine in a process of its own (auto: always); inproc: in the API process")
    s.add_argument("--platform", default=None, help="override platform detection (cuda/rocm/npu/xpu/cpu)")
    s.add_argument("--distributed", choices=["none", "ray"], default=None,
                   help="where stage replicas run: local worker processes (none) or Ray actors (needs omnirt[ray])")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--threads", type=int, default=int(os.environ.get("OMNIRT_THREADS", "0")) or None,
                   help="torch intra-op threads")
    s.add_argument("--log-level", default="info")
    r = s.add_argument_group("realtime (/v1/realtime) limits")
    r.add_argument("--realtime-max-sessions", type=int, default=32)
    r.add_argument("--realtime-max-event-bytes", type=int, default=20 * 2**20)
    r.add_argument("--realtime-max-input-buffer-s", type=float, default=120.0)
    r.add_argument("--realtime-idle-timeout-s", type=float, default=300.0)
    r.add_argument("--realtime-max-audio-rate", type=float, default=4.0,
                   help="input audio may come this many times faster than real time (sustained) before the "
                        "session is closed (1008)")
    r.add_argument("--realtime-audio-burst-s", type=float, default=30.0,
                   help="seconds of input audio a session may send ahead of that rate at once")
    s.add_argument("--webrtc-ice-address", action="append", default=None, dest="ice_addresses",
                   help="host address WebRTC offers as ICE candidate (repeatable; default: --host when it is one "
                        "address, else every interface but loopback)")
    s.add_argument("--webrtc-connect-timeout-s", type=float, default=30.0,
                   help="a WebRTC call that is not connected this long after its answer is closed")
    sub.add_parser("bench", help="benchmark a running server: chat (`omnirt bench --help`) or voice sessions "
                                 "(`omnirt bench realtime --help`)", add_help=False)
    s.add_argument("--log-format", choices=["text", "json"], default="text", help="structured log lines")
    add_reliability_args(s)
    return p


def add_reliability_args(s: argparse.ArgumentParser) -> None:
    """Limits, security and shutdown; env vars are read here, once."""
    env = os.environ.get
    s.add_argument("--api-key", action="append", default=[k for k in [env("OMNIRT_API_KEY")] if k],
                   help="require this Bearer key on /v1/* (repeatable; default $OMNIRT_API_KEY; none: open)")
    s.add_argument("--api-keys-file", type=Path, default=env("OMNIRT_API_KEYS_FILE") or None,
                   help="YAML/JSON keys with an id and limits each (docs/security.md); re-read when it changes or "
                        "on SIGHUP (default $OMNIRT_API_KEYS_FILE)")
    s.add_argument("--demo-key-id", default=None,
                   help="with keys on, the demo page gets client secrets minted under this key id (its limits "
                        "apply); without it the page cannot connect")
    s.add_argument("--cors-origins", default="",
                   help="comma-separated origins allowed by CORS and for WebSocket/WebRTC pages of other origins "
                        "(default: none: only the server's own origin)")
    s.add_argument("--max-body-bytes", type=int, default=32 * 2**20)
    s.add_argument("--max-audio-seconds", type=float, default=300.0, help="longest input audio per request")
    s.add_argument("--max-output-buffer-bytes", type=int, default=None,
                   help="unread output a request may hold before it is aborted (default: profile, 8 MiB)")
    s.add_argument("--slow-client-timeout", type=float, default=30.0,
                   help="disconnect a client that takes no streamed data for this many seconds")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, running responses may finish within this many seconds")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's flags as plain values: they cross to the engine core process."""
    return EngineOptions(
        model=args.model, deploy_config=str(args.deploy_config) if args.deploy_config else None,
        load_format=args.load_format, dtype=args.dtype, stage_overrides=dict(args.stage_overrides or {}),
        moe_backend=args.moe_backend, attention=args.attention, compile=args.compile,
        enforce_eager=args.enforce_eager,
        async_chunk=not args.no_async_chunk, async_output=not args.no_async_output,
        prefix_caching=not args.no_prefix_caching, engine=args.engine,
        platform=args.platform, distributed=args.distributed, threads=args.threads,
        max_output_buffer_bytes=args.max_output_buffer_bytes, process=args.engine_process,
        log_level=args.log_level, log_format=args.log_format)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.ops.lifecycle import DrainingServer
    from app.ops.logs import setup
    from app.realtime.session import RealtimeLimits
    from app.server import ServerSettings, create_app

    _check_keys(args)
    try:
        engine = start_engine(engine_options(args), log_setup=setup)
    except EngineStartError as exc:
        sys.exit(f"omnirt: {exc}")
    info = engine.info()
    name = args.served_model_name or args.model
    limits = RealtimeLimits(args.realtime_max_sessions, args.realtime_max_event_bytes,
                            args.realtime_max_input_buffer_s, args.realtime_idle_timeout_s,
                            max_audio_rate=args.realtime_max_audio_rate, audio_burst_s=args.realtime_audio_burst_s,
                            send_timeout_s=args.slow_client_timeout)
    settings = ServerSettings(
        model_names=(name,), system_prompt=info.system_prompt, max_body_bytes=args.max_body_bytes,
        max_audio_s=args.max_audio_seconds, api_keys=tuple(args.api_key), api_keys_file=args.api_keys_file,
        demo_key_id=args.demo_key_id,
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        slow_client_timeout_s=args.slow_client_timeout, shutdown_timeout_s=args.shutdown_timeout,
        realtime=limits, ice_addresses=_ice_addresses(args), webrtc_connect_timeout_s=args.webrtc_connect_timeout_s)
    app = create_app(engine, settings)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    signal.signal(signal.SIGHUP, lambda *_: app.state.keys.reload())  # `kill -HUP PID`: re-read the keys file
    # frames a bit over the realtime event limit still arrive, so that they get an `error` event
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            ws_max_size=limits.max_event_bytes + 2**20,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    print(f"omnirt ready: http://{args.host}:{args.port}/  (model {name!r}, voices {', '.join(info.voices)}"
          f"{'' if app.state.keys.is_open else ', API key required'})", flush=True)
    try:
        DrainingServer(config, app.state.server.lifecycle, on_stopped=engine.stop).run()
    finally:
        engine.stop()
    health = engine.health()
    if not health.is_alive:
        sys.exit(f"omnirt: {health.reason}")


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
    """The addresses WebRTC offers: given ones, else the one the server listens on (127.0.0.1 by default)."""
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

    setup(args.log_level, getattr(args, "log_format", "text"))
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
