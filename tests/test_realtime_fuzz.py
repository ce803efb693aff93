"""Property-based fuzzing of Realtime client events (hypothesis) against a real server, over a few
WebSocket sessions (GA and beta, a fresh one every CASES_PER_SESSION cases): events of every type with
well-formed and junk fields at any depth, and events that cannot be valid (not JSON, binary frames,
not an object, unknown or non-string types, wrong field types, wrong nesting, bad base64, oversized).
After each case a sentinel event (retrieving an item that does not exist) marks where the case's
answers end. Every event that cannot be valid gets an `error` event (echoing its `event_id` where it
could be read); every error is well-formed and none is an `internal_error`; no session is closed; the
server stays up, and afterwards a normal session gets a whole spoken answer and a transcript of a commit,
with every slot free.
Each bug found this way is an explicit `@example` (checked to fail before its fix).

Client secrets minted with fuzzed settings (GA and beta): one the server mints starts a session whose
`session.created` carries exactly the settings the mint answered with; a handshake with a made-up secret
is refused (403), one with any other credential on this keyless server is let in."""

from __future__ import annotations

import base64
import collections
import json
import os

import httpx
import pytest
import websocket
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnirt.app.realtime.transcription import OPENAI_MODELS
from tests.conftest import ServerProcess
from tests.fuzz_helpers import (
    CHEAP,
    details,
    image_url,
    junk,
    modalities,
    opt,
    session,
    small_ints,
    sometimes_junk,
    text,
    tool_choice,
    tools,
    voices,
)
from tests.realtime_helpers import lost_audio, ws_url

NUM_CASES = int(os.environ.get("OMNIRT_RT_FUZZ_CASES", "8000"))
NUM_SECRET_CASES = int(os.environ.get("OMNIRT_RT_SECRET_FUZZ_CASES", "300"))
CASES_PER_SESSION = 600
MAX_EVENT_BYTES = 65536
SENTINEL = "sentinel-item-that-does-not-exist"
TALLY: collections.Counter = collections.Counter()

b64 = st.binary(max_size=960).map(lambda b: base64.b64encode(b).decode())  # odd lengths are not PCM16
audio = b64 | st.sampled_from(["", "@@@", "A", "AAA=", "==", "UklGRg=="])
item_ids = st.sampled_from(["a", "b", "c", "root", ""]) | st.text(max_size=6)
part = opt({"type": st.sampled_from(["input_text", "input_audio", "input_image", "text", "audio", "output_text",
                                     "bogus"])},
           optional={"text": sometimes_junk(text), "audio": sometimes_junk(audio), "transcript": st.text(max_size=9),
                     "image_url": sometimes_junk(image_url), "detail": sometimes_junk(details)})
message_item = opt({"type": sometimes_junk(st.just("message")),
                    "role": sometimes_junk(st.sampled_from(["user", "user", "assistant", "system", "tool"])),
                    "content": sometimes_junk(st.lists(sometimes_junk(part), max_size=3))},
                   optional={"id": sometimes_junk(item_ids)})
call_ids = st.sampled_from(["call_1", "call_2", ""]) | st.text(max_size=5)
function_item = opt({"type": st.sampled_from(["function_call", "function_call_output"])}, optional={
    "call_id": sometimes_junk(call_ids), "output": sometimes_junk(st.text(max_size=20)),
    "name": sometimes_junk(st.sampled_from(["get_weather", "roll"])), "role": st.just("user"),
    "arguments": sometimes_junk(st.sampled_from(['{"city": "Oslo"}', "{oops", ""])),
    "id": sometimes_junk(item_ids)})
item = message_item | message_item | function_item
response = opt({}, optional={
    "output_modalities": sometimes_junk(modalities), "max_output_tokens": sometimes_junk(small_ints | st.just("inf")),
    "instructions": sometimes_junk(text), "conversation": sometimes_junk(st.sampled_from(["auto", "none"])),
    "voice": sometimes_junk(voices), "metadata": junk, "input": junk, "tools": sometimes_junk(tools),
    "tool_choice": sometimes_junk(tool_choice),
    "talker_sampling": sometimes_junk(st.dictionaries(st.sampled_from(
        ["max_tokens", "min_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "bogus"]),
        small_ints | st.floats(allow_nan=True), max_size=3))})


def event(kind: str, optional: dict | None = None, **fields) -> st.SearchStrategy:
    return opt({"type": st.just(kind), **fields}, optional=optional or {})


# (how it is sent, payload, what must come back: None = anything well-formed, "echo" = an error with its
# event_id, "error" = an error that may not carry the event_id because the event could not be read)
shaped = st.one_of(
    event("session.update", session=sometimes_junk(session)),
    event("input_audio_buffer.append", audio=sometimes_junk(audio)),
    event("input_audio_buffer.commit"), event("input_audio_buffer.clear"),
    event("conversation.item.create", {"previous_item_id": sometimes_junk(item_ids)}, item=sometimes_junk(item)),
    event("conversation.item.truncate", item_id=sometimes_junk(item_ids), content_index=sometimes_junk(small_ints),
          audio_end_ms=sometimes_junk(small_ints)),
    event("conversation.item.delete", item_id=sometimes_junk(item_ids)),
    event("conversation.item.retrieve", item_id=sometimes_junk(item_ids)),
    event("response.create", {"response": sometimes_junk(response)}),
    event("response.cancel", {"response_id": sometimes_junk(st.text(max_size=6))}),
    event("output_audio_buffer.clear")).map(lambda ev: ("json", ev, None))
invalid = st.one_of(
    event("input_audio_buffer.append", audio=st.sampled_from(["@@@", "A", "%%%%"])),  # not base64
    event("input_audio_buffer.append", audio=junk.filter(lambda v: not isinstance(v, str))),
    event("session.update", session=st.lists(junk, max_size=2) | st.text(max_size=5)),  # wrong nesting
    event("conversation.item.create", item=st.fixed_dictionaries({
        "type": st.just("message"), "role": st.just("user"),
        "content": st.dictionaries(st.text(max_size=4), junk, max_size=2) | st.lists(st.text(max_size=4), min_size=1,
                                                                                    max_size=2)})),
    event("session.update", session=st.fixed_dictionaries({"input_audio_transcription": st.fixed_dictionaries({
        "model": st.text(max_size=8).filter(lambda m: m not in ("tiny", *OPENAI_MODELS))})})),  # unknown model
    event("session.update", session=st.fixed_dictionaries({"audio": st.fixed_dictionaries({
        "input": st.fixed_dictionaries({"transcription": junk.filter(lambda v: v is not None and not isinstance(
            v, dict))})})})),  # not an object
    st.text(max_size=12).map(lambda t: f"session.{t}").flatmap(lambda t: event(t)),  # unknown type
    opt({"type": junk.filter(lambda v: not isinstance(v, str))}),
).map(lambda ev: ("json", ev, "echo"))
unreadable = st.one_of(
    event("input_audio_buffer.clear", event_id=st.integers() | st.lists(st.integers(), max_size=2)).map(
        lambda ev: ("json", ev, "error")),
    st.text(max_size=30).map(lambda t: ("text", t, "error")),
    st.binary(max_size=30).map(lambda b: ("binary", b, "error")),
    st.lists(junk, max_size=3).map(lambda v: ("text", json.dumps(v), "error")),
    st.just(("json", {"type": "input_audio_buffer.append", "audio": "A" * (MAX_EVENT_BYTES + 10)}, "error")))
cases = st.one_of(shaped, shaped, shaped, invalid, unreadable)


class Sessions:
    """The current WebSocket; a fresh one (GA, then beta, in turn) every CASES_PER_SESSION cases."""

    def __init__(self, url: str):
        self.url, self.ws, self.num_cases = url, None, 0

    def next(self) -> websocket.WebSocket:
        if self.num_cases % CASES_PER_SESSION == 0:
            if self.ws is not None:
                self.ws.close()
            beta = (self.num_cases // CASES_PER_SESSION) % 2 == 1
            self.ws = websocket.create_connection(self.url, timeout=60, header=["OpenAI-Beta: realtime=v1"] if beta
                                                  else [])
            assert json.loads(self.ws.recv())["type"] == "session.created"
            TALLY["sessions"] += 1
        self.num_cases += 1
        return self.ws


def exchange(ws: websocket.WebSocket, n: int, how: str, payload) -> list[dict]:
    """Send one case and then the sentinel; every event up to the sentinel's error."""
    if how == "binary":
        ws.send_binary(payload)
    else:
        ws.send(payload if how == "text" else json.dumps(payload))
    ws.send(json.dumps({"type": "conversation.item.retrieve", "item_id": SENTINEL, "event_id": f"sentinel_{n}"}))
    events = []
    while (ev := json.loads(ws.recv()))["type"] != "error" or ev["error"]["event_id"] != f"sentinel_{n}":
        events.append(ev)
    return events


def check(events: list[dict], n: int, must: str | None) -> None:
    errors = [e["error"] for e in events if e["type"] == "error"]
    for err in errors:
        assert err["type"] in ("invalid_request_error", "server_error") and isinstance(err["code"], str), err
        assert isinstance(err["message"], str) and err["message"] and err["code"] != "internal_error", err
        TALLY[f"error {err['code']}"] += 1
    for failed in (e["error"] for e in events if e["type"] == "conversation.item.input_audio_transcription.failed"):
        assert set(failed) == {"type", "code", "message", "param"} and failed["code"] != "internal_error", failed
        TALLY[f"transcription failed {failed['code']}"] += 1
    TALLY["transcripts"] += sum(e["type"] == "conversation.item.input_audio_transcription.completed" for e in events)
    mine = [e for e in errors if e["event_id"] == f"fz_{n}" or must == "error" and e["event_id"] is None]
    assert must is None or mine, f"no error event for case {n}: {[e['type'] for e in events]}"
    for done in (e["response"] for e in events if e["type"] == "response.done"):
        failure = (done["status_details"] or {}).get("error") or {}
        assert failure.get("code") not in ("internal_error", "generation_failed"), done  # a step failed: a bug
        TALLY[f"response {done['status']} {failure.get('code') or ''}".strip()] += 1
    TALLY["cases"] += 1
    TALLY["must_fail" if must else "shaped"] += 1
    TALLY["events_back"] += len(events)


@pytest.fixture(scope="module")
def fuzz_server():
    srv = ServerProcess(["--stage-overrides", CHEAP, "--realtime-max-event-bytes", str(MAX_EVENT_BYTES),
                         "--realtime-max-input-buffer-s", "5", "--max-audio-seconds", "5"])
    yield srv
    srv.stop()


def test_fuzz_realtime_events(fuzz_server):
    sessions = Sessions(ws_url(fuzz_server))

    @settings(max_examples=NUM_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    @example(case=("json", {"type": "session.update", "session": {"input_audio_format": []}}, "echo"))
    @example(case=("json", {"type": "session.update", "session": {"audio": {"output": {"format": {"type": [1]}}}}},
                   "echo"))
    @example(case=("json", {"type": "response.create", "response": {"talker_sampling": {"seed": 0.5}}}, None))
    def run(case):
        how, payload, must = case
        n = sessions.num_cases
        if how == "json" and isinstance(payload, dict) and "event_id" not in payload:
            payload = {**payload, "event_id": f"fz_{n}"}
        check(exchange(sessions.next(), n, how, payload), n, must)

    try:
        run()
    finally:
        if sessions.ws is not None:
            sessions.ws.close()
    print(f"realtime fuzz: {dict(TALLY.most_common())}")
    assert TALLY["cases"] >= NUM_CASES and TALLY["must_fail"] > NUM_CASES // 10
    _assert_a_normal_session_works(fuzz_server)


credentials = st.tuples(st.sampled_from(["ek_", "ek_", "sk-", ""]),
                        st.text(alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789-_.~", max_size=24))


def test_fuzz_client_secret_sessions(fuzz_server):
    http = httpx.Client(base_url=fuzz_server.url, timeout=60)

    @settings(max_examples=NUM_SECRET_CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(settings_=sometimes_junk(session), beta=st.booleans(), credential=credentials)
    def run(settings_, beta, credential):
        path, body = ("/v1/realtime/sessions", settings_) if beta else ("/v1/realtime/client_secrets",
                                                                        {"session": settings_})
        r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404) and r.json().get("error", {}).get("code") != "internal_error", r.text
        TALLY[f"secret {r.status_code}"] += 1
        if r.status_code == 200:
            minted = r.json()
            value = (minted["client_secret"] if beta else minted)["value"]
            created = _session_created(ws_url(fuzz_server), f"Bearer {value}", beta)
            expected = {k: v for k, v in (minted if beta else minted["session"]).items()
                        if k not in ("id", "expires_at", "client_secret")}
            assert {k: v for k, v in created.items() if k != "id"} == expected
        made_up = "".join(credential)
        if made_up.startswith("ek_"):
            with pytest.raises(websocket.WebSocketBadStatusException) as exc:
                _session_created(ws_url(fuzz_server), f"Bearer {made_up}", beta)
            assert exc.value.status_code == 403
        else:
            assert _session_created(ws_url(fuzz_server), f"Bearer {made_up}", beta)["object"] == "realtime.session"

    run()
    print(f"client secret session fuzz: {dict(TALLY.most_common())}")
    assert TALLY["secret 200"] and TALLY["secret 400"]


def _session_created(url: str, authorization: str, beta: bool) -> dict:
    ws = websocket.create_connection(url, timeout=60, header=[f"Authorization: {authorization}",
                                                              *(["OpenAI-Beta: realtime=v1"] if beta else [])])
    try:
        event = json.loads(ws.recv())
    finally:
        ws.close()
    assert event["type"] == "session.created", event
    return event["session"]


def _assert_a_normal_session_works(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None
    ws = websocket.create_connection(ws_url(srv), timeout=60)
    try:
        events = [json.loads(ws.recv())]
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}}))
        ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 3}}))
        while events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv()))
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": None, "transcription": {"model": "whisper-1"}}}}}))
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(24000)).decode()}))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while (transcribed := json.loads(ws.recv()))["type"] != "conversation.item.input_audio_transcription.completed":
            assert transcribed["type"] != "conversation.item.input_audio_transcription.failed", transcribed
    finally:
        ws.close()
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete") and lost_audio(events, done["id"]) is None
    h = srv.wait_idle()
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0
