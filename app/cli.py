"""`omnirt serve`: build the engine from a deploy profile and serve it over HTTP."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DEPLOY_DIR = Path(__file__).resolve().parents[1] / "deploy"
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
    s.add_argument("--platform", default=None, help="override platform detection (cuda/rocm/npu/xpu/cpu)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--threads", type=int, default=int(os.environ.get("OMNIRT_THREADS", "0")) or None,
                   help="torch intra-op threads")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-format", choices=["text", "json"], default="text", help="structured log lines")
    add_reliability_args(s)
    return p


def add_reliability_args(s: argparse.ArgumentParser) -> None:
    """Limits, security and shutdown; env vars are read here, once."""
    env = os.environ.get
    s.add_argument("--api-key", action="append", default=[k for k in [env("OMNIRT_API_KEY")] if k],
                   help="require this Bearer key on /v1/* (repeatable; default $OMNIRT_API_KEY; none: open)")
    s.add_argument("--cors-origins", default="", help="comma-separated origins allowed by CORS (default: none)")
    s.add_argument("--max-body-bytes", type=int, default=32 * 2**20)
    s.add_argument("--max-event-bytes", type=int, default=16 * 2**20, help="largest WebSocket message")
    s.add_argument("--max-audio-seconds", type=float, default=300.0, help="longest input audio per request")
    s.add_argument("--max-output-buffer-bytes", type=int, default=None,
                   help="unread output a request may hold before it is aborted (default: profile, 8 MiB)")
    s.add_argument("--slow-client-timeout", type=float, default=30.0,
                   help="disconnect a client that takes no streamed data for this many seconds")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, running responses may finish within this many seconds")
    s.add_argument("--fault-inject", default=env("OMNIRT_FAULT_INJECT"), help=argparse.SUPPRESS)  # tests only


def load_engine(args: argparse.Namespace):
    """Profile -> platform merge -> models -> started engine. Shared by serve and the benchmarks."""
    import torch

    from pipeline.config import load_profile
    from pipeline.engine import OmniEngine
    from pipeline.models import load_models
    from pipeline.platform import detect_platform, get_platform

    if args.threads:
        torch.set_num_threads(args.threads)
    platform = get_platform(args.platform) if args.platform else detect_platform()
    profile = args.deploy_config or DEPLOY_DIR / ("tiny.yaml" if args.model == "tiny" else "qwen3_omni_moe.yaml")
    overrides = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype,
                 "max_output_buffer_bytes": getattr(args, "max_output_buffer_bytes", None),
                 "fault_injection": getattr(args, "fault_inject", None)}
    cfg = load_profile(profile, platform.name, overrides, args.stage_overrides)
    log.info("platform %s, profile %s, model %s (%s, %s)", platform.name, profile, cfg.model, cfg.load_format,
             cfg.dtype)
    for s in cfg.stages:
        log.info("stage %d %-8s max_num_seqs=%d max_model_len=%d eager=%s devices=%s", s.stage_id, s.name,
                 s.max_num_seqs, s.max_model_len, s.enforce_eager, s.devices)
    engine = OmniEngine(cfg, load_models(cfg, platform))
    engine.start()
    return engine


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.lifecycle import DrainingServer
    from app.server import ServerSettings, create_app
    from pipeline.config import ProfileError
    from pipeline.models import ModelNotFoundError

    try:
        engine = load_engine(args)
    except (ProfileError, ModelNotFoundError) as exc:
        sys.exit(f"omnirt: {exc}")
    name = args.served_model_name or args.model
    settings = ServerSettings(
        model_names=(name,), system_prompt=engine.cfg.system_prompt, max_body_bytes=args.max_body_bytes,
        max_event_bytes=args.max_event_bytes, max_audio_s=args.max_audio_seconds, api_keys=tuple(args.api_key),
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
        slow_client_timeout_s=args.slow_client_timeout, shutdown_timeout_s=args.shutdown_timeout)
    app = create_app(engine, settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            ws_max_size=args.max_event_bytes, timeout_graceful_shutdown=args.shutdown_timeout + 5)
    print(f"omnirt ready: http://{args.host}:{args.port}/  (model {name!r}, voices {', '.join(engine.voices)}"
          f"{', API key required' if settings.api_keys else ''})", flush=True)
    try:
        DrainingServer(config, app.state.server.lifecycle).run()
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from app.logs import setup

    setup(args.log_level, getattr(args, "log_format", "text"))
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
