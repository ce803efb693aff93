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
    s.add_argument("--distributed", choices=["none", "ray"], default=None,
                   help="where stage replicas run: local worker processes (none) or Ray actors (needs omnirt[ray])")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--threads", type=int, default=int(os.environ.get("OMNIRT_THREADS", "0")) or None,
                   help="torch intra-op threads")
    s.add_argument("--log-level", default="info")
    return p


def load_engine(args: argparse.Namespace):
    """Profile -> platform merge -> models -> started engine. Shared by serve and the benchmarks."""
    import torch

    from pipeline.config import load_profile
    from pipeline.engine import OmniEngine
    from pipeline.models import load_models
    from pipeline.platform import detect_platform, get_platform
    from pipeline.ray_replica import require_ray

    if args.threads:
        torch.set_num_threads(args.threads)
    platform = get_platform(args.platform) if args.platform else detect_platform()
    profile = args.deploy_config or DEPLOY_DIR / ("tiny.yaml" if args.model == "tiny" else "qwen3_omni_moe.yaml")
    overrides = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype,
                 "distributed": args.distributed}
    cfg = load_profile(profile, platform.name, overrides, args.stage_overrides)
    if cfg.distributed == "ray":
        require_ray()  # fail before loading weights when the extra is missing
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

    from app.server import ServerSettings, create_app
    from pipeline.config import ProfileError
    from pipeline.models import ModelNotFoundError
    from pipeline.ray_replica import RayUnavailableError

    try:
        engine = load_engine(args)
    except (ProfileError, ModelNotFoundError, RayUnavailableError) as exc:
        sys.exit(f"omnirt: {exc}")
    name = args.served_model_name or args.model
    app = create_app(engine, ServerSettings(model_names=(name,), system_prompt=engine.cfg.system_prompt))
    print(f"omnirt ready: http://{args.host}:{args.port}/  (model {name!r}, voices {', '.join(engine.voices)})",
          flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
