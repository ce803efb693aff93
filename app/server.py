"""The FastAPI app: routes, limits, static demo page; the engine is built elsewhere and passed in."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from app import chat
from app.errors import APIError, error_response, install_error_handlers
from pipeline.engine import OmniEngine

log = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parents[1] / "web"


@dataclass(slots=True)
class ServerSettings:
    model_names: tuple[str, ...] = ("tiny",)
    system_prompt: str | None = None
    max_body_bytes: int = 32 * 2**20
    max_audio_s: float = 300.0


@dataclass(slots=True)
class OmniServer:
    """What the routes share: the engine and the settings (read-only after start)."""

    engine: OmniEngine
    settings: ServerSettings
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


def create_app(engine: OmniEngine, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="omnirt", version="0.1.0")
    app.state.server = OmniServer(engine, settings)
    install_error_handlers(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > settings.max_body_bytes):
            return error_response(APIError(413, f"request body over {settings.max_body_bytes} bytes",
                                           code="payload_too_large"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_names[0], "active_requests": engine.num_active_requests,
                "free_slots": engine.num_free_slots(), "slots": engine.num_slots()}

    @app.get("/v1/models")
    async def models():
        created = int(app.state.server.started_at)
        return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "omnirt"}
                                           for n in settings.model_names]}

    @app.get("/v1/voices")
    async def voices():
        return JSONResponse({"voices": engine.voices, "default": engine.cfg.default_voice})

    app.include_router(chat.router)
    if WEB_DIR.is_dir():
        app.mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web")
    return app
