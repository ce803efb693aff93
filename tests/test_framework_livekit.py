"""LiveKit Agents' OpenAI plugin (`livekit.plugins.openai.realtime.RealtimeModel`) against a real server, its
`RealtimeSession` driven directly as an `AgentSession` drives it (there is no LiveKit room here), at the
plugin's defaults (`gpt-realtime`, `semantic_vad`, voice `marin`, transcription) with only `base_url` changed.
A text turn (`update_chat_ctx` + `generate_reply`, which wait for the server's acknowledgements), a spoken
turn (`push_audio`) ended by the default turn detection, a function tool LiveKit runs, and `interrupt` +
`truncate` during an answer; no `error` reaches the session and the plugin logs none."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Literal

from livekit import rtc
from livekit.agents import llm
from livekit.plugins.openai.realtime import RealtimeModel

from tests.framework_helpers import API_KEY, WireTap, speak

INSTRUCTIONS = "You are a weather assistant. Be brief."


@llm.function_tool
async def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather where the user is."""
    return f"21 degrees {unit}, sunny"


@asynccontextmanager
async def livekit_session(server, caplog, **options):
    """A `RealtimeSession` of a default `RealtimeModel` (plus `options`), its wire tapped through the plugin's
    own raw-event hooks; yields (session, tap, events). On leaving, no `error` may have reached it."""
    model = RealtimeModel(api_key=API_KEY, base_url=f"http://127.0.0.1:{server.port}/v1", **options)
    session = model.session()
    tap, events = WireTap(), []
    session.on("openai_client_event_queued", tap.sent.append)
    session.on("openai_server_event_received", tap.received.append)
    for kind in ("error", "generation_created", "input_speech_started", "input_speech_stopped",
                 "input_audio_transcription_completed"):
        session.on(kind, lambda ev, kind=kind: events.append((kind, ev)))
    caplog.set_level(logging.WARNING, logger="livekit")
    try:
        await session.update_instructions(INSTRUCTIONS)
        await tap.until(lambda: len(tap.of("session.updated")) == 2, "both session.updates acknowledged")
        yield session, tap, events
    finally:
        await session.aclose()
        await model.aclose()
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("livekit") and r.levelno >= logging.ERROR]
    errors = [ev.error for kind, ev in events if kind == "error"]
    assert not tap.errors() and not errors and not logged, f"{tap.errors() or errors or logged}\n{tap.transcript()}"


async def say(session, text: str) -> None:
    """The user's text into the conversation, as `AgentSession` puts it there (waits for the server's ack)."""
    chat_ctx = session.chat_ctx.copy()
    chat_ctx.add_message(role="user", content=text)
    await session.update_chat_ctx(chat_ctx)


async def collect(generation: llm.GenerationCreatedEvent) -> tuple[list[rtc.AudioFrame], list[llm.FunctionCall]]:
    """All of a generation's audio frames and function calls, as the agent's playout would read them."""
    frames = []
    async for message in generation.message_stream:
        frames += [frame async for frame in message.audio_stream]
        _ = [text async for text in message.text_stream]
    calls = [call async for call in generation.function_stream]
    return frames, calls


async def test_defaults_connect_and_a_text_turn_is_answered(server, caplog):
    async with livekit_session(server, caplog) as (session, tap, _):
        await say(session, "Hello! What is the weather like?")
        generation = await session.generate_reply()  # waits for response.created echoing its metadata
        frames, _ = await collect(generation)
        done = await tap.until_done(1, "the answer")
        (user_item,) = tap.of("conversation.item.added")[:1]
        chat_ctx = session.chat_ctx.copy()
        chat_ctx.items = [item for item in chat_ctx.items if item.id != user_item["item"]["id"]]
        await session.update_chat_ctx(chat_ctx)  # a delete, which waits for the server's ack
    assert [e["item_id"] for e in tap.of("conversation.item.deleted")] == [user_item["item"]["id"]]
    first = tap.sent_of("session.update")[0]["session"]
    assert first["model"] == "gpt-realtime"  # the plugin names OpenAI's model
    assert first["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"  # and its turn detection
    now = tap.of("session.updated")[-1]["session"]
    assert now["instructions"] == INSTRUCTIONS and now["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert now["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
    assert generation.user_initiated and done["metadata"]["client_event_id"] == tap.sent_of("response.create")[0][
        "event_id"]
    assert done["status"] in ("completed", "incomplete") and sum(f.samples_per_channel for f in frames) > 0


async def test_a_spoken_turn_is_ended_by_the_default_turn_detection(server, caplog, speech):
    async with livekit_session(server, caplog) as (session, tap, events):
        session.update_options(max_response_output_tokens=16)

        def push(chunk: bytes) -> None:
            session.push_audio(rtc.AudioFrame(data=chunk, sample_rate=24000, num_channels=1,
                                              samples_per_channel=len(chunk) // 2))

        await speak(push, speech, lambda: any(kind == "input_speech_stopped" for kind, _ in events))
        await tap.until(lambda: any(kind == "generation_created" for kind, _ in events), "the server's answer")
        generation = next(ev for kind, ev in events if kind == "generation_created")
        frames, _ = await collect(generation)
        await tap.until_done(1, "the answer")
        await tap.until(lambda: any(kind == "input_audio_transcription_completed" and ev.is_final
                                    for kind, ev in events), "the user's speech transcribed")
    assert not generation.user_initiated and not tap.sent_of("response.create")
    assert sum(f.samples_per_channel for f in frames) > 0


async def test_a_function_tool_is_called_and_run_by_livekit(server, caplog):
    async with livekit_session(server, caplog) as (session, tap, _):
        await session.update_tools([get_weather])
        await say(session, "What is the weather?")
        # the tiny model's words are random: a named tool_choice makes its answer this call
        generation = await session.generate_reply(tool_choice={"type": "function",
                                                               "function": {"name": "get_weather"}})
        _, (call,) = await collect(generation)
        result = await llm.utils.execute_function_call(
            llm.FunctionToolCall(name=call.name, arguments=call.arguments, call_id=call.call_id), session.tools)
        chat_ctx = session.chat_ctx.copy()
        chat_ctx.items.append(result.fnc_call_out)
        await session.update_chat_ctx(chat_ctx)  # as AgentSession hands a realtime model the result
        answer = await session.generate_reply()
        await collect(answer)
        await tap.until_done(2, "the answer to the tool's result")
    assert call.name == "get_weather" and result.fnc_call_out.output in ("21 degrees celsius, sunny",
                                                                         "21 degrees fahrenheit, sunny")
    (output,) = tap.function_outputs()
    assert output["call_id"] == call.call_id and output["output"] == result.fnc_call_out.output
    assert tap.done()[1]["status"] in ("completed", "incomplete")


async def test_interrupt_and_truncate_cut_the_answer_and_the_session_goes_on(server, caplog):
    async with livekit_session(server, caplog) as (session, tap, _):
        await say(session, "Tell me a long story.")
        generation = await session.generate_reply()
        message = await generation.message_stream.__anext__()
        first_frame = await message.audio_stream.__anext__()
        session.interrupt()  # what AgentSession does on a barge-in: cancel, then cut what was not heard
        session.truncate(message_id=message.message_id, modalities=["audio"],
                         audio_end_ms=int(first_frame.duration * 1000))
        cut = await tap.until_done(1, "the interrupted answer ends")
        await tap.until(lambda: tap.of("conversation.item.truncated"), "the truncation acknowledged")
        await say(session, "Then tell me a short one.")
        await collect(await session.generate_reply())
        second = await tap.until_done(2, "the next answer")
    assert (cut["status"], cut["status_details"]["reason"]) == ("cancelled", "client_cancelled")
    (truncated,) = tap.of("conversation.item.truncated")
    assert truncated["item_id"] == message.message_id == cut["output"][0]["id"]
    assert second["status"] in ("completed", "incomplete")
