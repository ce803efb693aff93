"""Property-based fuzzing of POST /v1/chat/completions and of the client-secret endpoints (hypothesis), and
of every operation in the app's OpenAPI schema (schemathesis), against a real server: zero 5xx, errors
always in OpenAI's shape and without stack traces, and the server serves a normal request afterwards.
Valid requests do run the model; the fuzz server's profile caps context lengths so that each one stays
cheap."""

from __future__ import annotations

import base64
import json
import os

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnirt.app.audio.pcm import encode_wav
from tests.conftest import ServerProcess
from tests.fuzz_helpers import CHEAP, details, image_url, junk, opt, session, small_ints, sometimes_junk

NUM_CASES = int(os.environ.get("OMNIRT_FUZZ_CASES", "1500"))
NUM_SCHEMA_CASES = int(os.environ.get("OMNIRT_SCHEMA_CASES", "300"))
NUM_SECRET_CASES = int(os.environ.get("OMNIRT_SECRET_FUZZ_CASES", "600"))
WAV = base64.b64encode(encode_wav((np.sin(np.arange(8000) / 9) * 9000).astype("<i2").tobytes(), 16000)).decode()
TALLY = {"cases": 0, "2xx": 0, "4xx": 0, "5xx": 0}


@pytest.fixture(scope="module")
def fuzz_server():
    srv = ServerProcess(["--stage-overrides", CHEAP, "--max-audio-seconds", "5"])
    yield srv
    srv.stop()


audio_part = st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.fixed_dictionaries({
    "data": st.sampled_from([WAV, "", "@@@", "UklGRg=="]) | st.binary(max_size=48).map(lambda b: base64.b64encode(
        b).decode()), "format": st.sampled_from(["wav", "flac", "mp3", "pcm16"]) | st.text(max_size=4)})})
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": sometimes_junk(st.text(max_size=40))})
image_part = st.fixed_dictionaries({"type": st.just("image_url"), "image_url": sometimes_junk(opt(
    {"url": sometimes_junk(image_url)}, optional={"detail": sometimes_junk(details)}))})
parts = st.lists(sometimes_junk(text_part | audio_part | image_part), max_size=3)
schema = st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}},  # empty range
    {"type": "objekt"}, {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "("}, {}, {"enum": []},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"anyOf": [{"type": "null"}, {"const": 1}]},
]) | st.dictionaries(st.sampled_from(["type", "properties", "required", "items", "enum", "x"]), junk, max_size=3)
function = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "roll", "bad name", ""])},
                                 optional={"parameters": sometimes_junk(schema), "description": st.text(max_size=8),
                                           "strict": st.booleans()})
tools = st.lists(sometimes_junk(st.fixed_dictionaries({"type": st.just("function"), "function": function})),
                 max_size=3)
tool_choice = st.sampled_from(["none", "auto", "required", "sometimes"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "roll", "nope"])})})
response_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]) | st.builds(
    lambda s, strict: {"type": "json_schema", "json_schema": {"name": "out", "schema": s, "strict": strict}},
    schema, st.booleans())
call_function = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "x"]),
                                       "arguments": st.sampled_from(['{"city": "Oslo"}', "{oops", ""])})
tool_call = st.fixed_dictionaries({"id": st.just("call_1"), "type": st.just("function"), "function": call_function})
message = sometimes_junk(st.fixed_dictionaries(
    {"role": st.sampled_from(["user"] * 4 + ["system", "developer", "assistant", "tool", "robot"]),
     "content": st.none() | st.text(max_size=60) | parts},
    optional={"audio": junk, "name": st.text(max_size=5), "tool_calls": sometimes_junk(st.lists(tool_call, max_size=2)),
              "tool_call_id": st.text(max_size=6)}))
chat_body = st.fixed_dictionaries(
    {"model": sometimes_junk(st.sampled_from(["tiny"] * 8 + ["gpt-4o", ""])),
     "messages": sometimes_junk(st.lists(message, min_size=1, max_size=3))},
    optional={
        "modalities": sometimes_junk(st.sampled_from([["text"], ["text", "audio"], ["audio"]])
                                     | st.lists(st.sampled_from(["text", "audio", "video"]), max_size=3)),
        "audio": sometimes_junk(st.fixed_dictionaries({"voice": st.sampled_from(["ethan", "chelsie", "NOBODY", ""]),
                                                       "format": st.sampled_from(["wav", "pcm16", "mp3"])})),
        "stream": sometimes_junk(st.booleans()),
        "stream_options": sometimes_junk(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "max_tokens": sometimes_junk(small_ints), "max_completion_tokens": sometimes_junk(small_ints),
        "temperature": sometimes_junk(st.floats(allow_nan=True, allow_infinity=True)),
        "top_p": sometimes_junk(st.floats(-1, 2)), "seed": sometimes_junk(small_ints),
        "n": sometimes_junk(st.sampled_from([1, 1, 1, 0, 2])),
        "talker_sampling": sometimes_junk(st.dictionaries(
            st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_k", "top_p", "seed",
                             "repetition_penalty", "bogus"]), small_ints | st.floats(allow_nan=True) | junk,
            max_size=3)),
        "initial_codec_chunk_frames": sometimes_junk(st.integers(-2, 70)),
        "tools": sometimes_junk(tools), "tool_choice": sometimes_junk(tool_choice),
        "parallel_tool_calls": sometimes_junk(st.booleans()), "response_format": sometimes_junk(response_format),
    })


expires_after = opt({}, optional={"anchor": sometimes_junk(st.sampled_from(["created_at", "now"])),
                                   "seconds": sometimes_junk(st.integers(0, 8000) | small_ints)})
secret_body = opt({}, optional={"expires_after": sometimes_junk(expires_after), "session": sometimes_junk(session)})
beta_body = st.builds(lambda s, extra: {**s, **extra}, session, opt({}, optional={
    "model": sometimes_junk(st.sampled_from(["tiny", "gpt-4o"])),
    "client_secret": sometimes_junk(opt({}, optional={"expires_after": sometimes_junk(expires_after)}))}))


def check_response(r: httpx.Response) -> None:
    TALLY["cases"] += 1
    TALLY[f"{r.status_code // 100}xx"] = TALLY.get(f"{r.status_code // 100}xx", 0) + 1
    assert r.status_code < 500, r.text[:500]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])


def test_fuzz_chat_bodies(fuzz_server):
    client = httpx.Client(base_url=fuzz_server.url, timeout=60)

    @settings(max_examples=NUM_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=sometimes_junk(chat_body), raw=st.sampled_from([False, False, False, True]))
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, raw=False)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e-320}, raw=False)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"],
                   "audio": {"voice": "ethan"}, "talker_sampling": {"temperature": 2**64}}, raw=False)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"],
                   "audio": {"voice": "ethan"}, "talker_sampling": {"temperature": 1e-320}}, raw=False)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"],
                   "audio": {"voice": "ethan"}, "talker_sampling": {"repetition_penalty": 1e-320}}, raw=False)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"],
                   "audio": {"voice": "ethan"}, "talker_sampling": {"temperature": float("inf")}}, raw=True)
    @example(body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"],
                   "audio": {"voice": "ethan"}, "talker_sampling": {"seed": -(2**70)}}, raw=False)
    def run(body, raw):
        if raw:  # as bytes: sometimes not even JSON (NaN/Infinity, truncated)
            content = json.dumps(body).encode()[: len(json.dumps(body)) - (len(json.dumps(body)) % 3 == 0)]
            r = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        else:
            r = client.post("/v1/chat/completions", json=json.loads(json.dumps(body)) if _finite(body) else None)
        check_response(r)

    run()
    print(f"chat fuzz: {TALLY}")
    _assert_alive(fuzz_server)


def test_fuzz_client_secret_bodies(fuzz_server):
    """POST /v1/realtime/client_secrets (GA) and /v1/realtime/sessions (beta) with fuzzed settings: an error in
    OpenAI's shape naming the parameter, or a secret with the settings it carries."""
    client = httpx.Client(base_url=fuzz_server.url, timeout=60)

    @settings(max_examples=NUM_SECRET_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.tuples(st.just("/v1/realtime/client_secrets"), sometimes_junk(secret_body))
           | st.tuples(st.just("/v1/realtime/sessions"), sometimes_junk(beta_body)))
    def run(case):
        path, body = case
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        check_response(r)
        if r.status_code == 200:
            answer = r.json()
            secret = answer if path.endswith("client_secrets") else answer["client_secret"]
            assert secret["value"].startswith("ek_") and isinstance(secret["expires_at"], int)
            assert (answer["session"] if "session" in answer else answer)["object"] == "realtime.session"
        elif r.status_code in (400, 404):
            err = r.json()["error"]  # names the parameter, or says the body is the problem
            assert err["param"] is not None or "body" in err["message"] or err["code"] == "invalid_json", r.text

    run()
    print(f"client secret fuzz: {TALLY}")
    _assert_alive(fuzz_server)


def _finite(body) -> bool:
    try:
        json.dumps(body, allow_nan=False)
        return True
    except ValueError:
        return False


def _assert_alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    h = srv.wait_idle()
    assert h["free_slots"] == h["slots"]


def test_schemathesis_no_server_errors(fuzz_server):
    """Every operation of /openapi.json, with schemathesis' generated cases (valid and not)."""
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/models", "/health",
                                              "/v1/realtime/client_secrets", "/v1/realtime/sessions"}
    for op in operations:
        @settings(max_examples=NUM_SCHEMA_CASES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            r = case.call(base_url=fuzz_server.url, timeout=60)
            TALLY["schema_cases"] = TALLY.get("schema_cases", 0) + 1
            assert r.status_code < 500, f"{case.method} {case.path}: {r.status_code} {r.text[:300]}"
            assert "Traceback" not in r.text

        run()
    print(f"schemathesis: {TALLY}")
    _assert_alive(fuzz_server)
