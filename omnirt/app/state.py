"""What the app is given (`ServerSettings`, from the flags) and what its routes share (`AppState`: the
engine client, the settings, the registries, the limits, the metrics), set once by `create_app` and read
through `app_state(request)`, `app_state(websocket)` or `app_state(app)`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from omnirt.app.images import ImageLimits
from omnirt.app.ops.front_end_load import FrontEndLoad
from omnirt.app.ops.keys import KeyRing
from omnirt.app.ops.lifecycle import Lifecycle
from omnirt.app.ops.metrics import Metrics
from omnirt.app.ops.quotas import KeyQuotas
from omnirt.app.ops.secret_store import SecretStore
from omnirt.app.ops.shared import SharedLimits
from omnirt.app.ops.worker_link import WorkerContext, WorkerLink
from omnirt.app.realtime.config import SessionConfig
from omnirt.app.realtime.registry import SessionRegistry
from omnirt.app.realtime.session import RealtimeLimits
from omnirt.app.transports.ice import IceSettings
from omnirt.pipeline.api import EngineClient, FrontEndLimits


@dataclass(slots=True)
class ServerSettings:
    model_names: tuple[str, ...] = ("tiny",)
    system_prompt: str | None = None
    max_body_bytes: int = 32 * 2**20
    max_audio_s: float = 300.0
    images: ImageLimits = field(default_factory=ImageLimits)  # chat requests' and Realtime conversations' images
    realtime: RealtimeLimits = field(default_factory=RealtimeLimits)
    ice: IceSettings = field(default_factory=IceSettings)  # WebRTC candidates: host addresses, NAT, STUN/TURN
    webrtc_connect_timeout_s: float = 30.0
    webrtc_max_input_lag_s: float = 1.0  # microphone audio older than this, not yet taken by the session, is dropped
    api_keys: tuple[str, ...] = ()  # none (and no keys file): no key needed
    api_keys_file: Path | None = None  # keys with ids and limits, reloaded when it changes (omnirt.app.ops.keys)
    demo_key_id: str | None = None  # the demo page's client secrets are minted under this key (omnirt.app.demo)
    cors_origins: tuple[str, ...] = ()  # none: CORS closed, and only same-origin pages may connect
    # names the server answers to besides localhost and IP addresses (omnirt.app.ops.hosts): --allowed-hosts and --host
    allowed_hosts: tuple[str, ...] = ()
    slow_client_timeout_s: float = 30.0  # a write the client does not take within this disconnects it
    shutdown_timeout_s: float = 30.0  # running responses may finish within this after SIGTERM
    front_end: FrontEndLimits | None = None  # refuse new Realtime sessions past these loads (None: never)


@dataclass(slots=True)
class AppState:
    """What the routes share. The limits' counts and the client secrets are this process's own, or with
    `--api-workers` the supervisor's (`omnirt.app.ops.shared`), reached through proxies."""

    engine: EngineClient
    settings: ServerSettings  # read-only after start
    metrics: Metrics
    lifecycle: Lifecycle
    keys: KeyRing
    shared: SharedLimits
    client_secrets: SecretStore[SessionConfig]
    quotas: KeyQuotas
    sessions: SessionRegistry  # the open Realtime sessions of every transport
    load: FrontEndLoad  # this process's front-end load: event-loop lag, the VAD's backlog
    worker: WorkerContext | None = None  # this app is one of `--api-workers` processes
    worker_link: WorkerLink | None = None  # to the sibling workers (with `worker`)
    # the WebRTC calls, with the `webrtc` extra: an `omnirt.app.transports.webrtc.CallRegistry`, typed by its `calls()`
    webrtc: object | None = None
    started_at: float = field(default_factory=time.time)


def app_state(where: HTTPConnection | Starlette) -> AppState:
    """The app's state, from a request or WebSocket or from the app itself."""
    app = where.app if isinstance(where, HTTPConnection) else where
    return app.state.omnirt
