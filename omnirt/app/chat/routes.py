"""POST /v1/chat/completions in OpenAI's shapes: text or text+audio, streaming (SSE) or not, with tool calls.

With audio output, as in OpenAI's API, the text arrives as the audio's transcript
(`message.audio.transcript`, `delta.audio.transcript`) and `content` is null; the audio is base64 in
`audio.format`: a whole file in the non-streaming body (`message.audio.data`); when streaming, each
`delta.audio.data` is the next piece of the file, as the encoder has it (`wav` streams its 24 kHz mono
PCM16 samples, as `pcm16` does: a WAV header would need the length first).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omnirt.app.audio.files import StreamEncoder, encode_file
from omnirt.app.chat.protocol import ChatRequest, check_fields, to_engine_messages
from omnirt.app.chat.tool_calls import check_tools, delta_tool_call, engine_response_format, message_tool_calls
from omnirt.app.errors import APIError
from omnirt.app.model_names import served_model
from omnirt.app.ops.admission import check_draining, overloaded_error
from omnirt.app.state import app_state
from omnirt.pipeline.api import (
    AudioChunk,
    EngineDeadError,
    EngineOverloaded,
    Finished,
    OmniRequest,
    RequestError,
    TextDelta,
    ToolCallDelta,
    collect_reply,
)

router = APIRouter()
AUDIO_TTL_S = 3600


async def _engine_request(body: ChatRequest, request: Request) -> OmniRequest:
    st = app_state(request)
    settings = st.settings
    check_fields(body)
    served = served_model(body.model, settings.model_names, st.engine.info().model_aliases)
    if served is None:
        raise APIError(404, f"the model {body.model!r} does not exist; served: {', '.join(settings.model_names)} "
                       "(or an alias: GET /v1/models)", "model", "model_not_found")
    body.model = served  # answers name the served model, an alias resolved (as OpenAI names an alias's snapshot)
    wants_audio = "audio" in body.modalities
    if wants_audio and body.audio is None:
        raise APIError(400, "audio output needs the `audio` parameter ({voice, format})", "audio",
                       "missing_audio_params")
    tools = body.tools or []
    tool_choice = check_tools(tools, body.tool_choice)
    response_format = engine_response_format(body.response_format)
    # decoding audio files and images is not the event loop's work
    messages = await asyncio.to_thread(to_engine_messages, body.messages, st.engine.info().input_sample_rate,
                                       settings.max_audio_s, settings.images)
    if settings.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": settings.system_prompt})
    return OmniRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}", messages=messages, modalities=tuple(body.modalities),
        voice=body.audio.voice if body.audio else None, thinker_sampling=body.thinker_overrides(),
        talker_sampling=body.talker_sampling or {}, initial_codec_chunk_frames=body.initial_codec_chunk_frames,
        cache_salt=request.state.principal.key_id, tools=[t.model_dump(exclude_none=True) for t in tools],
        tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    started = time.monotonic()
    st = app_state(request)
    check_draining(st.lifecycle)
    req = await _engine_request(body, request)
    try:
        events = await st.engine.submit(req)
    except RequestError as exc:
        raise APIError(400, str(exc), exc.param, exc.code) from exc
    except EngineOverloaded as exc:
        st.metrics.requests.labels("chat", "rejected").inc()
        raise overloaded_error(exc) from exc
    except EngineDeadError as exc:  # the core died before it took the request: nothing was streamed yet
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    events = st.metrics.observe(events, "chat", started, {"request_id": req.request_id,
                                                           "key_id": request.state.principal.key_id})
    rate = st.engine.info().output_sample_rate
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ClosingStreamingResponse(_sse(body, req, events, include_usage, rate), media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _until_done_or_gone(_collect(body, req, events, rate), request)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends. When `send` fails (a client that went away,
    or was cut off for not reading), the generator would otherwise stay suspended until a garbage
    collection, and with it the request's cleanup and its metrics."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _until_done_or_gone(work, request: Request) -> JSONResponse:
    """Collect the whole reply, but abort in every stage if the client goes away first."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # unwinds the event stream, whose cleanup aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return JSONResponse({}, status_code=499)
    return task.result()


async def _collect(body: ChatRequest, req: OmniRequest, events: AsyncIterator, rate: int) -> JSONResponse:
    reply = await collect_reply(events)
    fin = reply.finished
    _raise_if_failed(fin)
    message: dict = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls else None,
                     "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = message_tool_calls(reply.tool_calls)
    if req.wants_audio and not reply.pcm16 and reply.tool_calls:  # a reply that only calls tools says nothing
        message["content"], message["audio"] = None, None
    elif req.wants_audio:
        data = await asyncio.to_thread(encode_file, reply.pcm16, rate, body.audio.format)
        message["content"] = None
        message["audio"] = {"id": f"audio_{uuid.uuid4().hex}", "data": base64.b64encode(data).decode(),
                            "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": reply.text}
    return JSONResponse({
        "id": req.request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model,
        "choices": [{"index": 0, "message": message, "finish_reason": fin.finish_reason, "logprobs": None}],
        "usage": _usage(fin)})


def _raise_if_failed(fin: Finished | None) -> None:
    if fin is None or fin.finish_reason == "error":
        raise APIError(500, f"generation failed: {fin.error if fin else 'no result'}", code="generation_failed")
    if fin.error:  # ended by the server, e.g. at the shutdown deadline
        raise APIError(503, fin.error, code="request_aborted")


def _usage(fin: Finished) -> dict:
    u = fin.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "text_tokens": u.prompt_text_tokens,
                                      "audio_tokens": u.prompt_audio_tokens, "image_tokens": u.prompt_image_tokens},
            "completion_tokens_details": {"audio_tokens": u.audio_frames, "reasoning_tokens": 0}}


async def _sse(body: ChatRequest, req: OmniRequest, events: AsyncIterator, include_usage: bool, rate: int):
    created, audio_id = int(time.time()), f"audio_{uuid.uuid4().hex}"
    encoder = StreamEncoder(body.audio.format if req.wants_audio else "pcm16", rate)

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True) -> str:
        payload = {"id": req.request_id, "object": "chat.completion.chunk", "created": created,
                   "model": body.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
                   if choices else []}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": None if req.wants_audio else ""})
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield chunk({"audio": {"id": audio_id, "transcript": ev.text}} if req.wants_audio
                            else {"content": ev.text})
            elif isinstance(ev, ToolCallDelta):
                yield chunk({"tool_calls": [delta_tool_call(ev.index, ev.call_id, ev.name, ev.arguments)]})
            elif isinstance(ev, AudioChunk) and (data := await asyncio.to_thread(encoder.encode, ev.pcm16)):
                yield chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode()}})
            elif isinstance(ev, Finished):
                if ev.error:  # failed, or ended by the server (shutdown, unread output): say why, in-stream
                    code = "generation_failed" if ev.finish_reason == "error" else "request_aborted"
                    err = {"message": ev.error, "type": "server_error", "param": None, "code": code}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    return
                if req.wants_audio:  # with the encoder's last bytes
                    tail = await asyncio.to_thread(encoder.close)
                    yield chunk({"audio": {"id": audio_id, "expires_at": created + AUDIO_TTL_S,
                                           **({"data": base64.b64encode(tail).decode()} if tail else {})}})
                yield chunk({}, ev.finish_reason)
                if include_usage:
                    yield chunk({}, usage=_usage(ev), choices=False)
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # a client that went away frees its slots in every stage
