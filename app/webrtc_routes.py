"""HTTP signalling for WebRTC calls: an SDP offer in, the answer out (`POST /v1/realtime/calls`, GA, and
`POST /v1/realtime?model=…`, beta), and `POST /v1/realtime/calls/{id}/hangup`. A call is refused with
OpenAI's error shape when the Realtime session limit or the engine's wait queues are full; the call
itself lives in `app.webrtc`.
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.admission import check_admission
from app.errors import APIError
from app.webrtc import Call, CallRegistry, offer_host_addresses

router = APIRouter()
TRANSPORT = "webrtc"
MAX_SDP_BYTES = 64 * 1024


def install(app: FastAPI, ice_addresses: tuple[str, ...] = (), connect_timeout_s: float = 30.0) -> None:
    offer_host_addresses(ice_addresses)
    app.state.webrtc = CallRegistry(connect_timeout_s)
    app.router.on_shutdown.insert(0, app.state.webrtc.close_all)
    app.include_router(router)


@router.post("/v1/realtime/calls", status_code=201)
async def create_call(request: Request) -> Response:
    return await _call(request, beta=False, status=201)


@router.post("/v1/realtime")
async def create_call_beta(request: Request) -> Response:
    return await _call(request, beta=True, status=201)


@router.post("/v1/realtime/calls/{call_id}/hangup")
async def hangup(call_id: str, request: Request) -> JSONResponse:
    call = request.app.state.webrtc.calls.get(call_id)
    if call is None:
        raise APIError(404, f"no call {call_id!r}", "call_id", "call_not_found")
    await call.end("hangup")
    return JSONResponse({})


async def _call(request: Request, beta: bool, status: int) -> Response:
    offer = await _read_offer(request)
    server, sessions = request.app.state.server, request.app.state.realtime
    model = request.query_params.get("model") or server.model_names[0]
    if model not in server.model_names:
        raise APIError(404, f"the model {model!r} does not exist; served: {', '.join(server.model_names)}",
                       "model", "model_not_found")
    try:
        if sessions.is_full:
            raise APIError(429, f"the server has {sessions.limits.max_sessions} realtime sessions open; try again "
                           "later", None, "session_limit_reached", headers={"Retry-After": "5"})
        check_admission(server)  # 429 when the engine's wait queues are full, 503 while draining
    except APIError:
        sessions.refused(TRANSPORT)
        raise
    call = Call(request, beta, model)
    sessions.try_add(call.session, TRANSPORT, functools.partial(call.end, state="shutdown"))  # room checked above
    request.app.state.webrtc.calls[call.id] = call
    try:
        answer = await call.answer(offer)
    except asyncio.CancelledError:
        call.end("signalling cancelled")
        raise
    except Exception as exc:  # aiortc raises ValueError and friends for offers it cannot use
        await call.end("bad offer", "failed")
        call.log.info("webrtc %s: refused the offer: %r", call.id, exc)
        raise APIError(400, f"the SDP offer cannot be used: {exc or type(exc).__name__}", "sdp",
                       "invalid_sdp") from exc
    call.log.info("webrtc %s: answered (model %s, beta %s, session %s); candidates offered %s, answered %s", call.id,
             model, beta, call.session.id, _candidates(offer), _candidates(answer))
    return Response(answer, status, media_type="application/sdp",
                    headers={"Location": f"/v1/realtime/calls/{call.id}"})


async def _read_offer(request: Request) -> str:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/sdp":
        raise APIError(415, f"the body must be an SDP offer with Content-Type: application/sdp (got "
                       f"{kind or 'none'!r})", None, "unsupported_content_type")
    body = await request.body()
    if len(body) > MAX_SDP_BYTES:
        raise APIError(413, f"the SDP offer is {len(body)} bytes; the limit is {MAX_SDP_BYTES}", "sdp",
                       "payload_too_large")
    try:
        sdp = body.decode()
    except UnicodeDecodeError as exc:
        raise APIError(400, "the SDP offer is not UTF-8 text", "sdp", "invalid_sdp") from exc
    if not sdp.lstrip().startswith("v=0"):
        raise APIError(400, "the body is not an SDP offer (it must start with `v=0`)", "sdp", "invalid_sdp")
    return sdp


def _candidates(sdp: str) -> list[str]:
    """`address:port type` of each ICE candidate (for the log: what ICE had to work with)."""
    fields = [line.split() for line in sdp.splitlines() if line.startswith("a=candidate:")]
    return [f"{f[4]}:{f[5]} {f[7]}" for f in fields if len(f) >= 8]
