"""Tool calls and structured output through the official `openai` SDK against a real server: forced calls
and schema outputs of the tiny model's random weights are valid JSON that validates against the schema,
streamed calls join to the same call, results fed back continue the conversation, a call speaks nothing;
bad tools, tool choices and schemas get OpenAI's error shape and the server goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MSG = [{"role": "user", "content": "What is the weather in Paris, and roll a die for me."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
DICE = {"type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
        "required": ["sides"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "roll_dice", "description": "Roll a die", "parameters": DICE}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_calls_whose_arguments_match_the_schema(client, seed):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", seed=seed,
                                       temperature=1.0, parallel_tool_calls=False, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=200,
                                       tool_choice={"type": "function", "function": {"name": "roll_dice"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "roll_dice" and r.choices[0].finish_reason == "tool_calls"
    _check_calls([call])


def test_parallel_calls_each_match_their_schema(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=400)
    calls = r.choices[0].message.tool_calls
    complete = calls if r.choices[0].finish_reason == "tool_calls" else calls[:-1]  # the last may be cut short
    _check_calls(complete)
    assert len({c.id for c in calls}) == len(calls)


def test_streamed_calls_arrive_in_pieces_and_join_to_the_same_call(client):
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, temperature=0, max_tokens=200,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    pieces, finish = [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces[0].id and pieces[0].function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 3  # the arguments stream as they are written
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments
    _check_calls([whole])


def test_results_fed_back_continue_the_conversation(client):
    first = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    history = MSG + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "21 C, sunny"})}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > client.chat.completions.create(model="tiny", messages=MSG,
                                                                  max_tokens=1).usage.prompt_tokens


def test_the_docs_example_runs_as_written(server):
    """docs/tools.md's example, taken from the page and pointed at this server: the forced call is whole JSON
    that `json.loads` reads, and the results fed back are answered."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert "http://127.0.0.1:8091/v1" in code
    scope: dict = {}
    exec(code.replace("http://127.0.0.1:8091/v1", f"{server.url}/v1"), scope)
    first = scope["messages"][1]
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    jsonschema.validate(scope["args"], scope["tools"][0]["function"]["parameters"])
    assert scope["r"].choices[0].message.content


def test_a_reply_that_is_a_call_speaks_nothing(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, modalities=["text", "audio"],
                                       audio={"voice": "ethan", "format": "wav"}, max_tokens=200)
    message = r.choices[0].message
    assert message.audio is None and r.usage.completion_tokens_details.audio_tokens == 0
    _check_calls(message.tool_calls)


class Booking(BaseModel):
    city: str = Field(max_length=10)
    nights: int = Field(ge=1, le=14)
    breakfast: bool


def test_a_strict_json_schema_through_the_sdks_parse(client):
    for seed in (1, 2):
        r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Book a hotel."}],
                                          response_format=Booking, seed=seed, temperature=1.0, max_tokens=200)
        assert isinstance(r.choices[0].message.parsed, Booking)


def test_json_object_is_an_object(client):
    """Any object: the random weights may write one longer than any budget, so this seed is one that ends."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer in JSON."}],
                                       response_format={"type": "json_object"}, temperature=1.0, seed=1,
                                       max_tokens=200)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def _body(**extra) -> dict:
    return {"model": "tiny", "messages": MSG, "max_tokens": 4, **extra}


BAD = [
    ("schema not JSON Schema", _body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]), "tools.0.function.parameters", "invalid_schema"),
    ("schema xgrammar cannot use", _body(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "#/$defs/missing"}}}]), "tools", "invalid_schema"),
    ("unknown function", _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice", "invalid_value"),
    ("required without tools", _body(tool_choice="required"), "tool_choice", "invalid_value"),
    ("tool_choice junk", _body(tools=TOOLS, tool_choice="always"), "tool_choice", "invalid_value"),
    ("bad function name", _body(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
     "tools.0.function.name", "invalid_value"),
    ("repeated function name", _body(tools=TOOLS + TOOLS[:1]), "tools.2.function.name", "invalid_value"),
    ("tool field unknown", _body(tools=[{"type": "function", "function": {"name": "f", "parmeters": {}}}]),
     "tools.0.function.parmeters", "unknown_parameter"),
    ("arguments not JSON", _body(messages=MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages.1.tool_calls.0.function.arguments", "invalid_value"),
    ("json_schema without its schema", _body(response_format={"type": "json_schema"}),
     "response_format.json_schema", "invalid_value"),
    ("response schema not JSON Schema", _body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 5}}}), "response_format.json_schema.schema", "invalid_schema"),
]


@pytest.mark.parametrize("name,body,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_tools_get_openai_errors_and_the_server_goes_on(server, name, body, param, code):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert err["message"] and "Traceback" not in r.text and ".cc:" not in err["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=_body(), timeout=60)
    assert ok.status_code == 200
