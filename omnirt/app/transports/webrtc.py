"""WebRTC voice calls, each a peer connection around a `RealtimeSession`, and their HTTP signalling:
`POST /v1/realtime/calls` (GA) or `POST /v1/realtime?model=…` (beta) takes an SDP offer and answers it,
`POST /v1/realtime/calls/{id}/hangup` ends a call (with the API key that started it, or minted the client
secret that did; other keys get 404). A call is refused with OpenAI's error shape when the
Realtime session limit, the API key's own `max_sessions` or the engine's wait queues are full (429), and
when the server drains or its front end is past its load limits (503, `omnirt.app.ops.front_end_load`). A client
secret on the offer (`Authorization: Bearer ek_…`) gives the call's session its settings.

The client posts an SDP offer (`Content-Type: application/sdp`) and gets the SDP answer back, as
with OpenAI. Then the microphone flows in as Opus (48 kHz, usually stereo), is resampled by PyAV to
the VAD's 16 kHz mono and fed to the same `RealtimeSession` as the WebSocket API; the agent's voice
flows out on a `PacedAudioTrack` (the session's audio sink); the Realtime JSON events travel both
ways on the data channel `oai-events`, exactly as over the WebSocket.

The app owns the calls (`AppState.webrtc`): a call ends when its connection fails or closes, its
data channel closes, no microphone audio arrives for `MEDIA_TIMEOUT_S`, it does not connect within
`connect_timeout_s`, the client posts
`/v1/realtime/calls/{id}/hangup`, or the server shuts down (all calls closed with `gather`, after an
`error` event that says why). Ending a call closes the session (which aborts its response in every
engine stage), stops the track, and cancels the call's tasks. Microphone audio the session has not taken
within `max_input_lag_s` is dropped, oldest first (`MicBacklog`): counted in
`omnirt_webrtc_input_dropped_seconds_total` and logged once per stall. WebRTC calls count against the Realtime
`max_sessions` limit and in the session metrics (transport "webrtc"); log lines carry the session id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from dataclasses import dataclass, field

import av
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from omnirt.app.audio.vad import VAD_RATE
from omnirt.app.client_secrets import http_error, starting_config
from omnirt.app.errors import APIError
from omnirt.app.ops.admission import check_admission
from omnirt.app.ops.lifecycle import SHUTDOWN_REASON
from omnirt.app.realtime.config import SessionConfig
from omnirt.app.realtime.events import ProtocolError, new_id
from omnirt.app.realtime.session import RealtimeSession
from omnirt.app.state import AppState, app_state
from omnirt.app.transports.ice import IceSettings, advertise, candidates, offer_host_addresses, rtc_configuration
from omnirt.app.transports.webrtc_track import MicBacklog, PacedAudioTrack

log = logging.getLogger(__name__)
router = APIRouter()
TRANSPORT = "webrtc"
MAX_SDP_BYTES = 64 * 1024
CHANNEL = "oai-events"
INPUT_CHUNK_SAMPLES = VAD_RATE * 40 // 1000  # mic audio reaches the session every 40 ms
MEDIA_TIMEOUT_S = 10.0  # no microphone frame for this long: the client is gone (ICE consent would take ~30 s)
MAX_CHANNEL_BUFFER_BYTES = 2**20
CLOSE_STEP_TIMEOUT_S = 2.0  # each step of closing a call; a peer that never finishes closing holds up nothing


@dataclass(slots=True)
class CallRegistry:
    """The app's calls: dropped when they end, all ended together on shutdown."""

    connect_timeout_s: float = 30.0  # ICE + DTLS must complete within this after the answer
    max_input_lag_s: float = 1.0  # microphone audio the session has not taken yet; older audio is dropped
    ice: IceSettings = field(default_factory=IceSettings)
    calls: dict[str, Call] = field(default_factory=dict)

    async def close_all(self) -> None:
        await asyncio.gather(*(c.end(SHUTDOWN_REASON, "shutdown") for c in list(self.calls.values())),
                             return_exceptions=True)


def call_registry(where: HTTPConnection | Starlette) -> CallRegistry:
    """The app's calls (`AppState.webrtc`, which `install` sets)."""
    registry = app_state(where).webrtc
    assert isinstance(registry, CallRegistry)
    return registry


class Call:
    """One WebRTC session: the peer connection, the Realtime session, and the tasks between them."""

    def __init__(self, request: Request, beta: bool, config: SessionConfig, key_id: str | None):
        st = app_state(request)
        self.registry = call_registry(request)
        self.sessions, self.limits = st.sessions, st.sessions.limits
        self.id = new_id("rtc")
        self.pc = RTCPeerConnection(rtc_configuration(self.registry.ice))  # no ICE server unless configured
        self.track = PacedAudioTrack(self.send, input_rate=st.engine.info().output_sample_rate)
        self.mic, self.metrics = MicBacklog(self.registry.max_input_lag_s), st.metrics
        self.session = RealtimeSession(st.engine, config, self.limits, self.sessions.vad, beta=beta,
                                       audio_sink=self.track, metrics=st.metrics, key_id=key_id)
        self.log = logging.LoggerAdapter(log, self.session.log_ids)
        self.channel = None
        self.channel_open = asyncio.Event()
        self.inbox: asyncio.Queue[str | bytes] = asyncio.Queue(self.limits.max_queued_events)
        self.tasks: list[asyncio.Task] = []
        self.writer: asyncio.Task | None = None  # drains the outbox on close, so it ends last
        self.closing: asyncio.Task | None = None
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    async def answer(self, offer_sdp: str) -> str:
        """Offer in, answer out (aiortc gathers all candidates first: no trickle ICE)."""
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
        if self.track not in (s.track for s in self.pc.getSenders()):
            raise ValueError("the offer has no audio section (m=audio) to send and receive on")
        for transceiver in self.pc.getTransceivers():  # video or a second audio: nobody would read it
            if transceiver.sender.track is not self.track:
                transceiver.direction = "inactive"
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        await self.session.start()
        self.writer = asyncio.create_task(self._write(), name=f"webrtc-{self.id}-write")
        self._spawn(self._read(), self._watchdog())
        return advertise(self.pc.localDescription.sdp, self.registry.ice.advertised_address)

    # ---- events of the peer connection ---------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        self.log.info("webrtc %s: %s track", self.id, track.kind)
        if track.kind == "audio" and self.track not in (s.track for s in self.pc.getSenders()):
            self.pc.addTrack(self.track)
            self._spawn(self._receive(track), self._listen())

    def _on_datachannel(self, channel) -> None:
        if channel.label != CHANNEL or self.channel is not None:
            self.log.info("webrtc %s: ignoring data channel %r", self.id, channel.label)
            return
        self.channel = channel
        channel.on("open", self.channel_open.set)
        if channel.readyState == "open":
            self.channel_open.set()
        channel.on("message", self._on_message)
        channel.on("close", lambda: self.end("data channel closed"))

    def _on_message(self, message: str | bytes) -> None:
        if len(message) > self.limits.max_event_bytes:
            self._refuse(ProtocolError(f"the event is {len(message)} bytes; the limit is "
                                       f"{self.limits.max_event_bytes}", "event_too_large"))
        elif self.inbox.full():
            self._refuse(ProtocolError("too many client events are waiting; the event was dropped",
                                       "rate_limit_exceeded"))
        else:
            self.inbox.put_nowait(message)

    def _on_state(self) -> None:
        state = self.pc.connectionState
        self.log.info("webrtc %s: connection %s", self.id, state)
        if state in ("failed", "closed"):
            self.end(f"connection {state}", "failed" if state == "failed" else "closed")

    # ---- the call's tasks ----------------------------------------------------------------------------

    async def _receive(self, track: MediaStreamTrack) -> None:
        """Microphone frames (48 kHz Opus, decoded as stereo s16) -> 16 kHz mono -> the backlog, as they come:
        the session takes them from there when it is ready (`_listen`), and a backlog past its bound drops old
        audio instead of growing."""
        resampler = av.AudioResampler(format="s16", layout="mono", rate=VAD_RATE)
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(track.recv(), MEDIA_TIMEOUT_S)
                except MediaStreamError:
                    return
                except TimeoutError:
                    self.end(f"no audio from the client for {MEDIA_TIMEOUT_S:g} s", "timeout")
                    return
                for f in resampler.resample(frame):
                    self.mic.push(f.to_ndarray().reshape(-1).astype(np.float32) / 32768.0)
        finally:
            self.mic.close()

    async def _listen(self) -> None:
        """The backlog -> the session, at least INPUT_CHUNK_SAMPLES at a time; drops are counted and logged."""
        while (taken := await self.mic.take(INPUT_CHUNK_SAMPLES)) is not None:
            samples, num_dropped = taken
            if num_dropped:
                self._dropped(num_dropped)
            await self.session.append_audio(samples, VAD_RATE)

    def _dropped(self, num_samples: int) -> None:
        self.metrics.mic_dropped.inc(num_samples / VAD_RATE)
        self.log.warning("webrtc %s: the session fell more than %d ms behind the microphone; dropped %d ms of old "
                         "audio (%d ms in this call)", self.id, self.mic.max_samples * 1000 // VAD_RATE,
                         num_samples * 1000 // VAD_RATE, self.mic.num_dropped_samples * 1000 // VAD_RATE)

    async def _read(self) -> None:
        while self.session.violation is None:
            await self.session.handle_text(await self.inbox.get())
        self.end(self.session.violation, "policy")

    async def _write(self) -> None:
        """The session's events -> the data channel; `response.done` tells the track the audio is all there.

        Events wait (in the bounded outbox) for the channel to open; a client without one loses them."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.channel_open.wait(), self.registry.connect_timeout_s)
        while (event := await self.session.outbox.get()) is not None:
            if event["type"] == "response.done":
                self.track.response_done(event["response"]["id"])
            while self.channel is not None and self.channel.bufferedAmount > MAX_CHANNEL_BUFFER_BYTES:
                await asyncio.sleep(0.01)  # a slow client: wait, and so the outbox fills and the session waits
            self.send(event)

    async def _watchdog(self) -> None:
        await asyncio.sleep(self.registry.connect_timeout_s)
        if self.pc.connectionState != "connected":
            self.end(f"not connected after {self.registry.connect_timeout_s:g} s", "timeout")

    def send(self, event: dict) -> None:
        """A server event on the data channel (dropped while it is not open: the client is not there)."""
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(event))

    def _refuse(self, exc: ProtocolError) -> None:
        self._spawn(self.session.send_error(exc))

    def _spawn(self, *coros) -> None:
        self.tasks = [t for t in self.tasks if not t.done()]
        self.tasks += [asyncio.create_task(c, name=f"webrtc-{self.id}") for c in coros]

    # ---- the end -------------------------------------------------------------------------------------

    def end(self, reason: str, state: str = "closed") -> asyncio.Task:
        """Close the call once, in a task of its own (callers may be the call's own tasks); `state` is how it
        ended, for /metrics: closed, timeout, failed, shutdown."""
        if self.closing is None:
            self.closing = asyncio.create_task(self._close(reason, state), name=f"webrtc-close-{self.id}")
        return self.closing

    async def _close(self, reason: str, state: str) -> None:
        self.log.info("webrtc %s: closing (%s)", self.id, reason)
        self.registry.calls.pop(self.id, None)
        self.sessions.remove(self.session, state)
        self.track.stop()
        await self._bounded("session close", self.session.close())  # aborts the response in every stage
        for task in self.tasks:
            task.cancel()
        if self.writer is not None:
            await self._bounded("event writer", self.writer)
        await self._bounded("call tasks", asyncio.gather(*self.tasks, return_exceptions=True))
        await self._bounded("peer connection close", self.pc.close())
        self.log.info("webrtc %s: closed", self.id)

    async def _bounded(self, what: str, step) -> None:
        """Await one closing step for at most CLOSE_STEP_TIMEOUT_S, then give up on it (cancelled, not
        awaited: aiortc's close can wait on a peer forever, and the shutdown must not)."""
        task = asyncio.ensure_future(step)
        await asyncio.wait({task}, timeout=CLOSE_STEP_TIMEOUT_S)
        if not task.done():
            task.cancel()
            # a cancelled gather ends holding its children's CancelledError: take it, or asyncio logs it as an
            # exception never retrieved, with a traceback, when the future is collected
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self.log.warning("webrtc %s: %s did not finish within %g s", self.id, what, CLOSE_STEP_TIMEOUT_S)
        elif not task.cancelled() and task.exception() is not None:
            self.log.warning("webrtc %s: %s failed: %r", self.id, what, task.exception())


# ---- signalling ------------------------------------------------------------------------------------


def install(app: FastAPI, st: AppState) -> CallRegistry:
    """The routes, and the registry of the calls (for `AppState.webrtc`)."""
    settings = st.settings
    offer_host_addresses(settings.ice.host_addresses)
    registry = CallRegistry(settings.webrtc_connect_timeout_s, settings.webrtc_max_input_lag_s, settings.ice)
    app.router.on_shutdown.insert(0, registry.close_all)
    if st.worker_link is not None:
        st.worker_link.handlers["hangup"] = lambda req: _linked_hangup(registry, req)
    app.include_router(router)
    return registry


async def _linked_hangup(registry: CallRegistry, request: dict) -> bytes:
    return b"ended" if await _hang_up(registry, request["call_id"], request["key_id"]) else b"none"


@router.post("/v1/realtime/calls", status_code=201)
async def create_call(request: Request) -> Response:
    return await _call(request, beta=False, status=201)


@router.post("/v1/realtime")
async def create_call_beta(request: Request) -> Response:
    return await _call(request, beta=True, status=201)


@router.post("/v1/realtime/calls/{call_id}/hangup")
async def hangup(call_id: str, request: Request) -> JSONResponse:
    """The call ends wherever it lives: here, or (`--api-workers`) in the sibling worker that answered its offer."""
    key_id, link = request.state.principal.key_id, app_state(request).worker_link
    if not await _hang_up(call_registry(request), call_id, key_id):
        answers = [] if link is None else await link.ask_others("hangup", call_id=call_id, key_id=key_id)
        if b"ended" not in (answer for _, answer in answers):
            raise APIError(404, f"no call {call_id!r}", "call_id", "call_not_found")
    return JSONResponse({})


async def _hang_up(registry: CallRegistry, call_id: str, key_id: str | None) -> bool:
    """End a call of this process, if it is there and `key_id`'s (only its own key may)."""
    call = registry.calls.get(call_id)
    if call is None or call.session.log_ids["key_id"] != key_id:
        return False
    await call.end("hangup")
    return True


async def _call(request: Request, beta: bool, status: int) -> Response:
    offer = await _read_offer(request)
    st, principal = app_state(request), request.state.principal
    sessions = st.sessions
    try:  # a client secret's settings, else the server's for ?model=
        config = starting_config(st, principal.secret, request.query_params.get("model"))
    except ProtocolError as exc:
        raise http_error(exc) from exc
    try:
        check_admission(st.engine, st.lifecycle, st.load)  # 429 engine full; 503 draining or front end at capacity
    except APIError:
        sessions.refused(TRANSPORT)
        raise
    error = sessions.refusal(TRANSPORT, principal.key)  # the server's session limit, or the key's (taken if None)
    if error is not None:
        raise APIError(429, error.message, None, error.code, headers={"Retry-After": "5"})
    call = Call(request, beta, config, principal.key_id)
    sessions.add(call.session, TRANSPORT, functools.partial(call.end, state="shutdown"))
    call_registry(request).calls[call.id] = call
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
                  config.model, beta, call.session.id, candidates(offer), candidates(answer))
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

