"""The FastAPI app: routes, limits, static demo page; the engine is built elsewhere and passed in."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from app import __version__, demo
from app.chat import routes as chat
from app.errors import install_error_handlers
from app.images import ImageLimits
from app.ops import metrics, security, shared
from app.ops.keys import KeyRing
from app.ops.lifecycle import Lifecycle
from app.ops.limits import BodySizeLimit, SlowClientGuard
from app.ops.metrics import Metrics, StatusCounter
from app.ops.quotas import KeyQuotas
from app.ops.secret_store import SecretStore
from app.ops.shared import SharedLimits
from app.ops.worker_link import WorkerContext, WorkerLink
from app.realtime import client_secrets
from app.realtime.session import RealtimeLimits
from app.transports import websocket
from app.transports.ice import IceSettings
from pipeline.api import EngineClient

log = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parents[1] / "web"


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
    api_keys_file: Path | None = None  # keys with ids and limits, reloaded when it changes (app.ops.keys)
    demo_key_id: str | None = None  # the demo page's client secrets are minted under this key (app.demo)
    cors_origins: tuple[str, ...] = ()  # none: CORS closed, and only same-origin pages may connect
    slow_client_timeout_s: float = 30.0  # a write the client does not take within this disconnects it
    shutdown_timeout_s: float = 30.0  # running responses may finish within this after SIGTERM


@dataclass(slots=True)
class OmniServer:
    """What the routes share: the engine and the settings (read-only after start)."""

    engine: EngineClient
    settings: ServerSettings
    metrics: Metrics
    lifecycle: Lifecycle
    started_at: float = field(default_factory=time.time)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.settings.model_names

    @property
    def system_prompt(self) -> str | None:
        return self.settings.system_prompt

    @property
    def max_audio_s(self) -> float:
        return self.settings.max_audio_s


def create_app(engine: EngineClient, settings: ServerSettings, worker: WorkerContext | None = None) -> FastAPI:
    """`worker`: this app is one of `--api-workers` processes (limits, secrets and /metrics span them all)."""
    lifecycle = Lifecycle(engine, settings.shutdown_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watch = asyncio.create_task(lifecycle.exit_when_engine_dies())
        if app.state.worker_link is not None:
            await app.state.worker_link.start()
            app.state.shared.worker_ready(worker.index, os.getpid())
        yield
        watch.cancel()
        if app.state.worker_link is not None:
            await app.state.worker_link.stop()

    app = FastAPI(title="omnirt", version=__version__, lifespan=lifespan)
    server = app.state.server = OmniServer(engine, settings, Metrics(engine), lifecycle)
    install_error_handlers(app)
    app.state.keys = KeyRing(settings.api_keys, settings.api_keys_file)
    _share(app, server.metrics, worker)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(SlowClientGuard, timeout_s=settings.slow_client_timeout_s)
    security.install(app, app.state.keys, app.state.client_secrets, app.state.quotas, settings.cors_origins)
    app.add_middleware(StatusCounter, metrics=server.metrics)

    @app.get("/health")
    async def health():
        alive, stats = engine.health(), engine.stats()
        body = {"status": "ok" if alive.is_alive else "engine_dead", "model": settings.model_names[0],
                "platform": engine.info().platform, "active_requests": engine.num_active_requests,
                "free_slots": {s.name: s.free_slots for s in stats.stages if s.slots},
                "slots": {s.name: s.slots for s in stats.stages if s.slots}, "replicas": stats.replicas}
        if not alive.is_alive:
            body["error"] = alive.reason
        if worker is not None:  # the engine's requests (from every worker), which worker answered, and every
            # worker's pid (None: starting) and open sessions
            body.update(active_requests=stats.active_requests, api_worker=worker.index,
                        api_workers=app.state.shared.worker_table(worker.count))
        return JSONResponse(body, status_code=200 if alive.is_alive else 503)

    @app.get("/v1/models")
    async def models():
        created = int(server.started_at)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "omnirt"}
                                           for n in settings.model_names]}

    @app.get("/v1/voices")
    async def voices():
        return JSONResponse(demo.voice_list(engine.info()))

    app.include_router(chat.router)
    app.include_router(client_secrets.router)
    demo.install(app, settings.demo_key_id, settings.ice.servers)
    websocket.install(app, replace(settings.realtime, images=settings.images))
    if importlib.util.find_spec("aiortc") is not None:  # the `webrtc` extra
        from app.transports import webrtc

        webrtc.install(app, settings.ice, settings.webrtc_connect_timeout_s, settings.webrtc_max_input_lag_s)
    app.include_router(metrics.router)
    if WEB_DIR.is_dir():
        app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    return app


def _share(app: FastAPI, metrics: Metrics, worker: WorkerContext | None) -> None:
    """The limits' counts and the client secrets: this process's own, or with `--api-workers` the
    supervisor's (app.ops.shared), with a link to the sibling workers (app.ops.worker_link)."""
    if worker is None:
        app.state.shared, app.state.client_secrets = SharedLimits(), SecretStore()
        app.state.worker_index, app.state.worker_link = 0, None
    else:
        app.state.shared, app.state.client_secrets = shared.connect(worker.shared_address, worker.authkey)
        app.state.worker_index, app.state.worker_link = worker.index, WorkerLink(worker, metrics)
    app.state.quotas = KeyQuotas(metrics, app.state.shared, app.state.worker_index)
