"""Tool calls over Realtime, through the official `openai` SDK's realtime client against a real server:
a forced call arrives as a `function_call` item with argument deltas that validate against the schema and
says nothing; its result fed back continues the conversation; a cancel during a call leaves it incomplete
and unannounced; bad tool input gets an `error` event and the session goes on."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.realtime_helpers import collect_until

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER},
         {"type": "function", "name": "roll_dice", "parameters": {"type": "object", "properties": {
             "sides": {"type": "integer", "minimum": 2, "maximum": 20}}, "required": ["sides"]}}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "tools": TOOLS}


@pytest.fixture(scope="module")
def client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=server.url.replace("http", "ws") + "/v1",
                              api_key="unused", max_retries=0)


async def _session(client, session: dict):
    conn = await client.realtime.connect(model="tiny").enter()
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session=session)
    updated = await conn.recv()
    assert updated.type == "session.updated", updated
    return conn, updated.session


async def _ask(conn, text: str, response: dict) -> list:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(response=response)
    return await collect_until(conn, lambda ev: ev.type == "response.done")


async def test_a_forced_call_is_a_function_call_item_that_says_nothing(client):
    conn, session = await _session(client, {**MANUAL, "tool_choice": "required"})  # audio out: the default
    try:
        assert [t.name for t in session.tools] == ["get_weather", "roll_dice"] and session.tool_choice == "required"
        events = await _ask(conn, "What is the weather in Oslo?", {"max_output_tokens": 200})
    finally:
        await conn.close()
    types = [e.type for e in events]
    assert not any(t.startswith(("response.output_audio", "response.content_part")) for t in types)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and all(e.item.type == "function_call" and e.item.arguments == "" for e in added)
    done = {e.item_id: e for e in events if e.type == "response.function_call_arguments.done"}
    for item in (e.item for e in added):
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == item.id]
        assert len(deltas) > 1 and "".join(deltas) == done[item.id].arguments
        assert done[item.id].call_id == item.call_id and done[item.id].name == item.name
        jsonschema.validate(json.loads(done[item.id].arguments), SCHEMAS[item.name])
    response = events[-1].response
    assert response.status == "completed" and [o.type for o in response.output] == ["function_call"] * len(added)
    assert response.usage.output_token_details.audio_tokens == 0


async def test_a_result_fed_back_continues_the_conversation(client):
    conn, _ = await _session(client, {**MANUAL, "output_modalities": ["text"]})
    try:
        events = await _ask(conn, "Roll a die.", {"tool_choice": {"type": "function", "name": "roll_dice"},
                                                  "max_output_tokens": 200})
        (call,) = [o for o in events[-1].response.output if o.type == "function_call"]
        assert call.name == "roll_dice" and call.status == "completed"
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                  "output": json.dumps({"rolled": 4})})
        added = await collect_until(conn, lambda ev: ev.type == "conversation.item.done")
        assert added[-1].item.type == "function_call_output" and added[-1].item.call_id == call.call_id
        await conn.response.create(response={"max_output_tokens": 8})
        answer = await collect_until(conn, lambda ev: ev.type == "response.done")
    finally:
        await conn.close()
    response, first = answer[-1].response, events[-1].response
    assert response.status in ("completed", "incomplete") and response.output
    # the same prompt, then the call and its result: all of the first prompt is reused
    assert response.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert response.usage.input_token_details.cached_tokens >= first.usage.input_tokens


async def test_a_cancel_during_a_call_leaves_it_incomplete_and_unannounced(client):
    conn, _ = await _session(client, {**MANUAL, "output_modalities": ["text"], "tool_choice": "required"})
    try:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Weather?"}]})
        await conn.response.create(response={"max_output_tokens": 200})
        before = await collect_until(conn, lambda ev: ev.type == "response.function_call_arguments.delta")
        await conn.response.cancel()
        after = await collect_until(conn, lambda ev: ev.type == "response.done")
    finally:
        await conn.close()
    assert not any(e.type == "response.function_call_arguments.done" for e in before + after)
    response = after[-1].response
    assert response.status == "cancelled" and response.status_details.reason == "client_cancelled"
    assert [(o.type, o.status) for o in response.output] == [("function_call", "incomplete")]


async def test_bad_tools_get_error_events_and_the_session_goes_on(client):
    conn, _ = await _session(client, {"type": "realtime", "output_modalities": ["text"],
                                      "audio": {"input": {"turn_detection": None}}})
    try:
        await conn.session.update(session={"tools": [{"type": "function", "name": "f",
                                                      "parameters": {"type": "objekt"}}]})
        bad_schema = await conn.recv()
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_x", "output": "1"})
        no_call = await conn.recv()
        events = await _ask(conn, "Hello", {"max_output_tokens": 4})
    finally:
        await conn.close()
    assert (bad_schema.type, bad_schema.error.code, bad_schema.error.param) == (
        "error", "invalid_schema", "session.tools.0.parameters")
    assert (no_call.type, no_call.error.param) == ("error", "item.call_id")
    assert events[-1].response.status in ("completed", "incomplete")


async def test_required_before_the_tools_is_kept_and_applies_once_they_arrive(client):
    """pipecat sends tool_choice "required" before its tools: no error (it would end pipecat's session); a
    response without tools has nothing to force and answers."""
    conn, session = await _session(client, {"type": "realtime", "output_modalities": ["text"],
                                            "tool_choice": "required", "audio": {"input": {"turn_detection": None}}})
    try:
        assert session.tool_choice == "required" and not session.tools
        answer = await _ask(conn, "Hello", {"max_output_tokens": 4})
        await conn.session.update(session={"tools": TOOLS})
        updated = await conn.recv()
        forced = await _ask(conn, "What is the weather in Oslo?", {"max_output_tokens": 200})
    finally:
        await conn.close()
    assert not [e for e in answer + forced if e.type == "error"]
    assert [o.type for o in answer[-1].response.output] == ["message"]
    assert updated.type == "session.updated" and updated.session.tool_choice == "required"
    assert {o.type for o in forced[-1].response.output} == {"function_call"}


async def test_a_forced_call_cut_short_by_max_output_tokens_is_incomplete_and_unannounced(client):
    """No `.done` with the start of some JSON (which pipecat would fail to parse): the item is `incomplete`
    and the response says why. (50 tokens: the tiny model's call is open, its arguments unfinished.)"""
    conn, _ = await _session(client, {**MANUAL, "output_modalities": ["text"]})
    try:
        events = await _ask(conn, "Weather in Oslo?", {"tool_choice": {"type": "function", "name": "get_weather"},
                                                       "max_output_tokens": 50})
    finally:
        await conn.close()
    response = events[-1].response
    assert not any(e.type in ("response.function_call_arguments.done", "error") for e in events)
    assert response.status == "incomplete" and response.status_details.reason == "max_output_tokens"
    (call,) = response.output
    assert (call.type, call.status) == ("function_call", "incomplete") and call.arguments.startswith('{"')
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete"
