"""The command line's flags: every one with help that ends with its default, and values checked as they
are parsed (bounds, JSON shapes, addresses), so that a bad one is refused before anything loads."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

from omnirt.app import __version__
from omnirt.app.transports.ice import check_address, parse_ice_servers
from omnirt.pipeline.api import DISTRIBUTED, DTYPES, PLATFORMS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
OVERRIDES_EXAMPLE = '\'{"talker": {"max_num_seqs": 8}}\''
# engine switches that became deploy profile keys (docs/operator-guide.md): the flag -> what replaces it
REMOVED_FLAGS = {
    "--no-async-chunk": "--set async_chunk=false",
    "--no-async-output": "--set async_output=false",
    "--no-first-packet-priority": "--set first_packet_priority=false",
    "--no-prefix-caching": "--set 'stages.*.prefix_caching=false'",
    "--compile": "--set compile=VALUE (auto, on, off)",
    "--attention": "--set attention=VALUE (auto, slots, dense)",
    "--moe-backend": "--set moe_backend=VALUE (auto, grouped_mm, batched_mm, eager, triton)",
    "--conv-backend": "--set conv_backend=VALUE (native, gemm, channels_last, triton)",
    "--engine": "--set engine=reference (transformers' generate(), the baseline)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what its default is (where
    "none" means something, e.g. "the profile's")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: {_shown(action.default).replace('%', '%%')})"


def _shown(default) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default is None or default in ([], {}, ()) else str(default)


def number(kind: type, low: float, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: an int or float within bounds, refused with the bounds named."""
    word = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {word}") from None
        if value != value or value < low or (above and value == low) or (high is not None and value > high):  # nan
            bounds = f"{'>' if above else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {word} {bounds}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _api_workers(text: str) -> int | str:
    """`auto` (resolved at start by `omnirt.app.cli`) or a count."""
    return text if text == "auto" else number(int, 1, 64)(text)


def _stage_overrides(text: str) -> dict[str, dict]:
    """`--stage-overrides`: JSON, stage id (or name) -> profile keys for that stage (the model's stages are
    checked with the profile)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); expected e.g. {OVERRIDES_EXAMPLE}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise argparse.ArgumentTypeError(f"must be a JSON object of stage -> {{key: value}}, e.g. {OVERRIDES_EXAMPLE}")
    return value


def _setting(text: str) -> str:
    """`--set KEY=VALUE`: the shape here; the key and value are checked with the profile."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. --set async_chunk=false")
    return text


class RemovedFlag(argparse.Action):
    """A flag that became a profile key: refused with what replaces it."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed: use {REMOVED_FLAGS[option_string]} "
                     "(a deploy profile key; docs/operator-guide.md)")


def _ice_servers(text: str):
    try:
        return parse_ice_servers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _address(text: str) -> str:
    try:
        return check_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnirt", description="Realtime voice-agent server for omni models",
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"omnirt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the server", formatter_class=HelpFormatter,
                       usage="omnirt serve [options]  (`omnirt serve --help` lists them)",
                       description="Serve a model over HTTP: OpenAI chat completions, the Realtime API (WebSocket "
                                   "and WebRTC), and the browser demo at /.")
    add_engine_args(s)
    add_server_args(s)
    add_realtime_args(s)
    add_reliability_args(s)
    sub.add_parser("bench", help="benchmark a running server: chat (`omnirt bench --help`) or voice sessions "
                                 "(`omnirt bench realtime --help`)", add_help=False)
    return p


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """What the engine is built from; None: the deploy profile's value."""
    g = s.add_argument_group("model and engine")
    g.add_argument("--model", default="tiny", help="'tiny' (built in), a local folder, or an HF-cache id "
                   "(never downloaded)")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: --model)")
    g.add_argument("--deploy-config", default=None, help="deploy profile: a YAML file, or a shipped profile by name "
                   "(tiny, qwen3_omni_moe_1gpu, ...; default: tiny for tiny, else qwen3_omni_moe)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="auto: the checkpoint's weights; dummy: the real architecture with random weights "
                        "(default: the profile's, else auto)")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights and activations (default: the profile's for the platform, else float32)")
    g.add_argument("--stage-overrides", default={}, type=_stage_overrides,
                   help=f"profile keys per stage as JSON, by id or name, e.g. {OVERRIDES_EXAMPLE}")
    g.add_argument("--set", action="append", default=[], type=_setting, dest="settings", metavar="KEY=VALUE",
                   help="any deploy profile key over the profile, its value read as YAML (repeatable): e.g. "
                        "--set dtype=bfloat16, --set connector.codec_chunk_frames=16, --set "
                        "stages.talker.max_num_seqs=32, --set 'stages.*.prefix_caching=false' (docs/operator-guide.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs and no compilation in any stage (slower; for debugging a device)")
    g.add_argument("--gpu-memory-utilization", type=number(float, 0, 1, above=True), default=None,
                   help="fraction of each device's memory the stages without their own profile fraction may use "
                        "(weights, KV caches, graphs); the KV caches grow into it (default: the profile's; "
                        "without one, KV for max_num_seqs requests only)")
    g.add_argument("--engine-process", choices=["auto", "core", "inproc"], default="auto",
                   help="core: the engine in a process of its own (auto: always); inproc: in the API process")
    g.add_argument("--platform", choices=PLATFORMS, default=None, help="override platform detection "
                   "(default: the first accelerator torch sees, else cpu)")
    g.add_argument("--distributed", choices=DISTRIBUTED, default=None,
                   help="where stage replicas run: local worker processes (none) or Ray actors (needs omnirt[ray]) "
                        "(default: the profile's, else none)")
    g.add_argument("--step-log", default=None, metavar="FILE",
                   help="append a line per engine step to FILE (time, stage, prefill or decode, requests, tokens, "
                        "ms): where a slow load's time went (docs/reliability.md, Observability)")
    g.add_argument("--threads", type=number(int, 1), default=int(os.environ.get("OMNIRT_THREADS", "0")) or None,
                   help="torch intra-op threads (default: $OMNIRT_THREADS, else torch's own choice)")
    for flag in REMOVED_FLAGS:
        g.add_argument(flag, action=RemovedFlag)


def add_server_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("HTTP and logs")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=number(int, 0, 65535), default=8091, help="port to listen on (0: any free one)")
    g.add_argument("--api-workers", type=_api_workers, default="auto",
                   help="API processes sharing the port and the one engine core (SO_REUSEPORT: Linux); each has its "
                        "own event loop, sessions and VAD; limits, client secrets and /metrics span them all. auto: "
                        "a quarter of the host's cores (the ones this process may use, within a container's CPU "
                        "quota), at most 8: each worker's loop and VAD take one to two cores and the engine core's "
                        "stage threads need the rest; 1 below 8 cores, with --engine-process inproc or off Linux. "
                        "The choice is logged and shown on the ready line (default: auto)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the server's and uvicorn's")
    g.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")


def add_realtime_args(s: argparse.ArgumentParser) -> None:
    r = s.add_argument_group("realtime (/v1/realtime) limits")
    r.add_argument("--realtime-max-sessions", type=number(int, 1), default=1000,
                   help="open Realtime sessions, WebSocket and WebRTC together, a backstop: more are refused "
                        "(WebSocket 1013, WebRTC 429). What a host admits is set by its load: past the deploy "
                        "profile's front_end limits (event-loop lag, VAD backlog) new sessions are refused "
                        "(docs/operator-guide.md)")
    r.add_argument("--realtime-max-event-bytes", type=number(int, 1024), default=20 * 2**20,
                   help="largest client event (an audio append carries base64)")
    r.add_argument("--realtime-max-input-buffer-s", type=number(float, 0, above=True), default=120.0,
                   help="seconds of input audio a session buffers before a turn is cut")
    r.add_argument("--realtime-idle-timeout-s", type=number(float, 0, above=True), default=300.0,
                   help="a session with no client event and no response running this long is closed")
    r.add_argument("--realtime-max-audio-rate", type=number(float, 1), default=4.0,
                   help="input audio may come this many times faster than real time (sustained) before the "
                        "session is closed (1008)")
    r.add_argument("--realtime-audio-burst-s", type=number(float, 0, above=True), default=30.0,
                   help="seconds of input audio a session may send ahead of that rate at once")
    w = s.add_argument_group("WebRTC (docs/webrtc.md)")
    w.add_argument("--webrtc-ice-address", action="append", type=_address, default=[], dest="ice_addresses",
                   help="host address ICE gathers candidates on (repeatable; default: --host when it is one "
                        "address, else every interface but loopback)")
    w.add_argument("--webrtc-advertise-address", type=_address, default=None,
                   help="the address the answer gives for those candidates, e.g. the public IP of a host behind "
                        "a 1:1 NAT (default: the gathered addresses themselves)")
    w.add_argument("--webrtc-ice-servers", type=_ice_servers, default=os.environ.get("OMNIRT_WEBRTC_ICE_SERVERS"),
                   help='STUN/TURN servers as JSON, e.g. \'[{"urls": "turn:turn.example.org:3478", "username": '
                        '"u", "credential": "p"}]\', or @FILE; also given to the demo page (default: '
                        "$OMNIRT_WEBRTC_ICE_SERVERS, else none: host candidates only)")
    w.add_argument("--webrtc-connect-timeout-s", type=number(float, 0, above=True), default=30.0,
                   help="a WebRTC call that is not connected this long after its answer is closed")
    w.add_argument("--webrtc-max-input-lag-s", type=number(float, 0, above=True), default=1.0,
                   help="microphone audio a call's session has not taken yet is bounded to this many seconds; an "
                        "overloaded server drops older audio (omnirt_webrtc_input_dropped_seconds_total) instead of "
                        "answering ever older speech")


def add_reliability_args(s: argparse.ArgumentParser) -> None:
    """Limits, security and shutdown; env vars are read here, once."""
    env = os.environ.get
    g = s.add_argument_group("security")
    g.add_argument("--api-key", action="append", default=[k for k in [env("OMNIRT_API_KEY")] if k],
                   help="require this Bearer key on /v1/* (repeatable; default: $OMNIRT_API_KEY, else none: open)")
    g.add_argument("--api-keys-file", type=Path, default=env("OMNIRT_API_KEYS_FILE") or None,
                   help="YAML/JSON keys with an id and limits each (docs/security.md); re-read when it changes or "
                        "on SIGHUP (default: $OMNIRT_API_KEYS_FILE, else none)")
    g.add_argument("--demo-key-id", default=None,
                   help="with keys on, the demo page gets client secrets minted under this key id (its limits "
                        "apply); without it (the default) the page cannot connect")
    g.add_argument("--cors-origins", default="",
                   help="comma-separated origins allowed by CORS and for WebSocket/WebRTC pages of other origins "
                        "(default: none: only the server's own origin)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated names the server answers to in the Host header, besides localhost, IP "
                        "addresses and --host (.example.com: with its subdomains; *: any name). Others get 403, a "
                        "guard against DNS rebinding (docs/security.md)")
    g = s.add_argument_group("limits and shutdown")
    g.add_argument("--max-body-bytes", type=number(int, 1024), default=32 * 2**20, help="largest HTTP request body")
    g.add_argument("--max-audio-seconds", type=number(float, 0, above=True), default=300.0,
                   help="longest input audio per request")
    g.add_argument("--max-image-bytes", type=number(int, 1024), default=10 * 2**20,
                   help="largest input image (encoded, before base64), chat and Realtime")
    g.add_argument("--max-image-pixels", type=number(int, 64), default=4096 * 4096,
                   help="most pixels (width x height) of an input image, read from its header before decoding")
    g.add_argument("--max-images", type=number(int, 0), default=8,
                   help="most images per chat request and per Realtime conversation")
    g.add_argument("--max-output-buffer-bytes", type=number(int, 4096), default=None,
                   help="unread output a request may hold before it is aborted (default: the profile's, 8 MiB)")
    g.add_argument("--slow-client-timeout", type=number(float, 0, above=True), default=30.0,
                   help="disconnect a client that takes no streamed data for this many seconds")
    g.add_argument("--shutdown-timeout", type=number(float, 0), default=30.0,
                   help="on SIGTERM, running responses may finish within this many seconds")
