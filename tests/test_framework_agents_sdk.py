"""The OpenAI Agents SDK (`openai-agents`) against a real server: a `RealtimeAgent` run by `RealtimeRunner` at
the SDK's defaults (its model name, `semantic_vad`, transcription, voice `ash`) with only the URL changed.
A text message, a spoken turn ended by the SDK's default turn detection, a function tool the SDK runs, and
`interrupt()` during an answer; no `error` event reaches the SDK in any of them."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Literal

import pytest
import websockets
from agents import function_tool, set_tracing_disabled
from agents.realtime import RealtimeAgent, RealtimeRunner, openai_realtime

from tests.framework_helpers import API_KEY, WireTap, speak

set_tracing_disabled(True)  # no network: the SDK would export its traces to api.openai.com
INSTRUCTIONS = "You are a weather assistant. Be brief."


@function_tool
def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather where the user is."""
    return f"21 degrees {unit}, sunny"


AGENT = RealtimeAgent(name="assistant", instructions=INSTRUCTIONS)
WEATHER_AGENT = RealtimeAgent(name="assistant", instructions=INSTRUCTIONS, tools=[get_weather])
SHORT = {"max_output_tokens": 16}  # short answers; every other setting the SDK's default


@pytest.fixture
def tap(monkeypatch):
    tap = WireTap()
    monkeypatch.setattr(openai_realtime.websockets, "connect", tap.wrap_connect(websockets.connect))
    return tap


@asynccontextmanager
async def agent_session(server, tap: WireTap, agent: RealtimeAgent = AGENT, **settings):
    """A session as the SDK's examples open one, the URL (the SDK's default one with our host) the only
    change; yields it with the list of its session events. On leaving, no `error` may have reached it."""
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model={openai_realtime.DEFAULT_REALTIME_MODEL}"
    runner = RealtimeRunner(agent, config={"model_settings": settings} if settings else None)
    session = await runner.run(model_config={"url": url, "api_key": API_KEY})
    events: list = []

    async def read():
        async for event in session:
            events.append(event)

    async with session:
        reader = asyncio.create_task(read())
        try:
            await tap.until(lambda: tap.of("session.updated"), "the session configured")
            yield session, events
        finally:
            reader.cancel()
    errors = [e.error for e in events if e.type == "error"]
    assert not tap.errors() and not errors, f"errors reached the SDK: {tap.errors() or errors}\n{tap.transcript()}"


async def test_defaults_configure_the_session_and_a_text_message_is_answered(server, tap):
    async with agent_session(server, tap) as (session, events):
        await session.send_message("Hello! What is the weather like?")
        done = await tap.until_done(1, "the answer to a text message")
        await tap.until(lambda: len(tap.of("session.updated")) == len(tap.sent_of("session.update")),
                    "every session.update acknowledged")
    sent = tap.sent_of("session.update")[0]["session"]
    assert sent["model"] == openai_realtime.DEFAULT_REALTIME_MODEL  # the SDK names OpenAI's model
    assert sent["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"  # and its turn detection
    session_now = tap.of("session.updated")[-1]["session"]
    assert session_now["instructions"] == INSTRUCTIONS
    assert session_now["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert session_now["audio"]["input"]["transcription"]["model"] == "gpt-4o-mini-transcribe"
    assert done["status"] in ("completed", "incomplete") and done["output"][0]["type"] == "message"
    assert any(e.type == "audio" for e in events) and any(e.type == "audio_end" for e in events)


async def test_a_spoken_turn_is_ended_by_the_default_turn_detection(server, tap, speech):
    async with agent_session(server, tap, **SHORT) as (session, events):
        await speak(session.send_audio, speech, lambda: bool(tap.of("input_audio_buffer.speech_stopped")))
        done = await tap.until_done(1, "the answer to the spoken turn")
        await tap.until(lambda: tap.of("conversation.item.input_audio_transcription.completed"),
                    "the user's speech transcribed")
    assert not tap.sent_of("response.create") and not tap.sent_of("input_audio_buffer.commit")
    assert len(tap.of("input_audio_buffer.speech_started")) == len(tap.of("input_audio_buffer.committed")) == 1
    assert done["status"] in ("completed", "incomplete") and any(e.type == "audio" for e in events)


async def test_a_function_tool_is_called_and_run_by_the_sdk(server, tap):
    # the tiny model's words are random: `required` makes its answer a call (and every answer after it)
    async with agent_session(server, tap, WEATHER_AGENT, tool_choice="required") as (session, events):
        await session.send_message("What is the weather?")
        await tap.until(lambda: any(e.type == "tool_end" for e in events), "the SDK ran the tool")
        await tap.until(lambda: len(tap.of("response.created")) >= 2, "a response to the tool's result")
    (call,) = [o for o in tap.done()[0]["output"]]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    tool_end = next(e for e in events if e.type == "tool_end")
    assert tool_end.output in ("21 degrees celsius, sunny", "21 degrees fahrenheit, sunny")
    outputs = tap.function_outputs()
    assert outputs[0]["call_id"] == call["call_id"] and outputs[0]["output"] == tool_end.output


async def test_interrupt_during_an_answer_cuts_it_and_the_session_goes_on(server, tap):
    async with agent_session(server, tap) as (session, events):
        await session.send_message("Tell me a long story.")
        await tap.until(lambda: tap.of("response.output_audio.delta"), "the answer's first audio")
        await session.interrupt()
        first = await tap.until_done(1, "the interrupted answer ends")
        await tap.until(lambda: any(e.type == "audio_interrupted" for e in events), "the SDK's audio_interrupted")
        await session.send_message("Then tell me a short one.")
        second = await tap.until_done(2, "the next answer")
    (truncate,) = tap.sent_of("conversation.item.truncate")
    assert truncate["item_id"] == first["output"][0]["id"]
    (truncated,) = tap.of("conversation.item.truncated")
    assert truncated["item_id"] == truncate["item_id"] and truncated["audio_end_ms"] <= truncate["audio_end_ms"]
    # With the default turn detection (`interrupt_response: true`) the SDK leaves the cancelling to the server
    # and only truncates what was heard; OpenAI's truncate does not cancel, so the answer ends as it would.
    assert not tap.sent_of("response.cancel") and first["status"] in ("completed", "incomplete")
    assert second["status"] in ("completed", "incomplete")
