"""May new work start? Chat requests are refused with 429 + Retry-After when the engine's wait queues
are full and with 503 while draining; a realtime endpoint asks `session_refusal` at connect and
closes the WebSocket with the code and reason it returns (1013 for a full engine or a front end past its
load limits, `omnirt.app.ops.front_end_load`), or, for WebRTC, `check_admission` (503 + Retry-After for the
front end's load)."""

from __future__ import annotations

import math

from omnirt.app.errors import APIError
from omnirt.app.ops.front_end_load import FrontEndLoad
from omnirt.app.ops.lifecycle import SHUTDOWN_REASON, Lifecycle
from omnirt.pipeline.api import EngineClient, EngineOverloaded

WS_TRY_AGAIN_LATER = 1013
WS_GOING_AWAY = 1001


def overloaded_error(exc: EngineOverloaded) -> APIError:
    return APIError(429, f"The server is at capacity: {exc}.", code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})


def draining_error() -> APIError:
    return APIError(503, f"The {SHUTDOWN_REASON} and accepts no new requests.", code="server_shutting_down",
                    headers={"Retry-After": "5"})


def check_draining(lifecycle: Lifecycle) -> None:
    if lifecycle.is_draining:
        raise draining_error()


def front_end_busy_error(reason: str, retry_after_s: float) -> APIError:
    return APIError(503, reason, code="server_busy", headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def session_refusal(engine: EngineClient, lifecycle: Lifecycle, load: FrontEndLoad,
                    wants_audio: bool = True) -> tuple[int, str] | None:
    """(close code, reason) if a new realtime session must be refused now, else None."""
    if lifecycle.is_draining:
        return WS_GOING_AWAY, SHUTDOWN_REASON
    try:
        engine.check_admission(wants_audio)
    except EngineOverloaded as exc:
        return WS_TRY_AGAIN_LATER, f"server at capacity ({exc.stage} stage full); retry in {exc.retry_after_s:.0f} s"
    busy = load.refusal()
    return None if busy is None else (WS_TRY_AGAIN_LATER, busy)


def check_admission(engine: EngineClient, lifecycle: Lifecycle, load: FrontEndLoad, wants_audio: bool = True) -> None:
    """Raise the HTTP error for a new session: 503 draining, 429 engine full (as a chat request would get), 503
    front end at capacity; each with Retry-After."""
    check_draining(lifecycle)
    try:
        engine.check_admission(wants_audio)
    except EngineOverloaded as exc:
        raise overloaded_error(exc) from exc
    busy = load.refusal()
    if busy is not None:
        raise front_end_busy_error(busy, engine.info().retry_after_s)
