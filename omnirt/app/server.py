"""The FastAPI app: its state (`AppState`), middleware, routes and the static demo page; the engine is built
elsewhere and passed in."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
from dataclasses import replace
from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.routing import Match, Mount

from omnirt.app import __version__, client_secrets, demo
from omnirt.app.chat import routes as chat
from omnirt.app.errors import install_error_handlers
from omnirt.app.model_names import listed_models
from omnirt.app.ops import security, shared
from omnirt.app.ops.front_end_load import FrontEndLoad
from omnirt.app.ops.keys import KeyRing
from omnirt.app.ops.lifecycle import SHUTDOWN_REASON, Lifecycle
from omnirt.app.ops.limits import BodySizeLimit, SlowClientGuard
from omnirt.app.ops.metrics import Metrics, StatusCounter
from omnirt.app.ops.quotas import KeyQuotas
from omnirt.app.ops.secret_store import SecretStore
from omnirt.app.ops.shared import SharedLimits
from omnirt.app.ops.worker_link import WorkerContext, WorkerLink
from omnirt.app.realtime.registry import SessionRegistry
from omnirt.app.state import AppState, ServerSettings
from omnirt.app.transports import websocket
from omnirt.pipeline.api import EngineClient

log = logging.getLogger(__name__)
WEB_DIR = Path(str(resources.files("omnirt") / "web"))  # package data: the same in a checkout and a wheel


def create_app(engine: EngineClient, settings: ServerSettings, worker: WorkerContext | None = None) -> FastAPI:
    """`worker`: this app is one of `--api-workers` processes (limits, secrets and /metrics span them all)."""
    st = _build_state(engine, settings, worker)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watch = asyncio.create_task(st.lifecycle.exit_when_engine_dies())
        st.load.start()
        if st.worker_link is not None:
            await st.worker_link.start()
            st.shared.worker_ready(worker.index, os.getpid())
        yield
        watch.cancel()
        st.load.stop()
        if st.worker_link is not None:
            await st.worker_link.stop()

    app = FastAPI(title="omnirt", version=__version__, lifespan=lifespan)
    app.state.omnirt = st  # read through `app_state(request)`
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(SlowClientGuard, timeout_s=settings.slow_client_timeout_s)
    security.install(app, st.keys, st.client_secrets, st.quotas, settings.cors_origins, settings.allowed_hosts)
    app.add_middleware(StatusCounter, metrics=st.metrics)
    st.lifecycle.on_deadline(st.sessions.end_all)  # after running responses finished, or at the deadline
    app.router.on_shutdown.append(functools.partial(st.sessions.end_all, SHUTDOWN_REASON))  # whatever is left

    @app.get("/health")
    async def health():
        alive, stats = engine.health(), engine.stats()
        body = {"status": "ok" if alive.is_alive else "engine_dead", "model": settings.model_names[0],
                "platform": engine.info().platform, "active_requests": engine.num_active_requests,
                "free_slots": {s.name: s.free_slots for s in stats.stages if s.slots},
                "slots": {s.name: s.slots for s in stats.stages if s.slots}, "replicas": stats.replicas,
                "front_end": st.load.figures().as_json()}  # this API process's load, and whether it admits
        if not alive.is_alive:
            body["error"] = alive.reason
        if worker is not None:  # the engine's requests (from every worker), which worker answered, and every
            # worker's pid (None: starting), open sessions and front-end load (None: did not answer)
            body.update(active_requests=stats.active_requests, api_worker=worker.index,
                        api_workers=await _worker_table(st, worker))
        return JSONResponse(body, status_code=200 if alive.is_alive else 503)

    @app.get("/v1/models")
    async def models():
        created = int(st.started_at)
        names = listed_models(settings.model_names, engine.info().model_aliases)  # the served ones first
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "omnirt"}
                                           for n in names]}

    @app.get("/v1/voices")
    async def voices():
        return JSONResponse(demo.voice_list(engine.info()))

    @app.get("/metrics", include_in_schema=False)
    async def metrics():  # with --api-workers, every worker's figures (omnirt.app.ops.metrics)
        body = st.metrics.render() if st.worker_link is None else await st.worker_link.merged_metrics()
        return Response(body, media_type="text/plain; version=0.0.4")

    app.include_router(chat.router)
    app.include_router(client_secrets.router)
    app.include_router(demo.router)
    app.include_router(websocket.router)
    if importlib.util.find_spec("aiortc") is not None:  # the `webrtc` extra (aiortc), optional
        from omnirt.app.transports import webrtc

        st.webrtc = webrtc.install(app, st)
    if WEB_DIR.is_dir():
        app.router.routes.append(WebPages("/", StaticFiles(directory=WEB_DIR, html=True), name="web"))
    return app


class WebPages(Mount):
    """The demo page's files at /, except under /v1/: there a wrong method gets the router's 405 (with
    `Allow`) and an unknown path its 404, in OpenAI's error shape, not the file server's 404."""

    def matches(self, scope) -> tuple[Match, dict]:
        return (Match.NONE, {}) if scope["path"].startswith("/v1/") else super().matches(scope)


async def _worker_table(st: AppState, worker: WorkerContext) -> list[dict]:
    """Every worker's row of /health, with its front-end figures (asked over the worker link)."""
    loads = {worker.index: st.load.figures().as_json(),
             **{k: json.loads(answer) for k, answer in await st.worker_link.ask_others("load")}}
    return [{**row, "front_end": loads.get(k)} for k, row in enumerate(st.shared.worker_table(worker.count))]


def _build_state(engine: EngineClient, settings: ServerSettings, worker: WorkerContext | None) -> AppState:
    """The limits' counts and the client secrets: this process's own, or with `--api-workers` the
    supervisor's (omnirt.app.ops.shared), with a link to the sibling workers (omnirt.app.ops.worker_link)."""
    metrics = Metrics(engine)
    if worker is None:
        limits, secrets, link = SharedLimits(), SecretStore(), None
    else:
        limits, secrets = shared.connect(worker.shared_address, worker.authkey)
        link = WorkerLink(worker, metrics)
    index = 0 if worker is None else worker.index
    sessions = SessionRegistry(replace(settings.realtime, images=settings.images), metrics, limits, index)
    load = FrontEndLoad(settings.front_end, sessions.vad.backlog)
    metrics.watch_load(load, index)
    if link is not None:
        link.handlers["load"] = lambda _: _load_answer(load)
    return AppState(engine, settings, metrics, Lifecycle(engine, settings.shutdown_timeout_s),
                    KeyRing(settings.api_keys, settings.api_keys_file), limits, secrets,
                    KeyQuotas(metrics, limits, index), sessions, load, worker, link)


async def _load_answer(load: FrontEndLoad) -> bytes:
    """A sibling worker's /health asks for this worker's front-end figures."""
    return json.dumps(load.figures().as_json()).encode()
