"""The Realtime wire protocol with a raw WebSocket client: beta names, malformed events, limits."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
import websockets

from tests.conftest import HANG_GUARD_S, ServerProcess
from tests.realtime_helpers import collect_until, mint_secret, recv, recv_type, until_done, ws_url


@pytest.fixture(scope="module")
def limited():
    """A server with small realtime limits, so that each can be hit quickly."""
    srv = ServerProcess(["--realtime-max-sessions", "2", "--realtime-max-event-bytes", "65536",
                         "--realtime-max-input-buffer-s", "3", "--realtime-idle-timeout-s", "5"])
    yield srv
    srv.stop()


async def test_beta_client_gets_beta_events(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                websocket_base_url=server.url.replace("http", "ws") + "/v1")
    async with client.beta.realtime.connect(model="tiny") as conn:  # sends OpenAI-Beta: realtime=v1
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.input_audio_format == "pcm16" and created.session.modalities == ["text", "audio"]
        assert created.session.turn_detection.prefix_padding_ms == 300
        await conn.session.update(session={"turn_detection": None, "output_audio_format": "g711_ulaw"})
        updated = await conn.recv()
        assert updated.type == "session.updated" and updated.session.output_audio_format == "g711_ulaw"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Hi there!"}]})
        await conn.response.create(response={"modalities": ["text", "audio"], "max_response_output_tokens": 6})
        events = await collect_until(conn, lambda e: e.type == "response.done")
    types = {e.type for e in events}
    assert {"conversation.item.created", "response.audio.delta", "response.audio_transcript.delta",
            "response.audio.done", "response.audio_transcript.done", "response.done"} <= types
    assert not any(t.startswith(("response.output_audio", "response.output_text")) or
                   t in ("conversation.item.added", "conversation.item.done") for t in types)
    done = events[-1].response
    assert done.modalities == ["text", "audio"] and done.output[0].content[0].type == "audio"
    ulaw = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.audio.delta")
    assert len(ulaw) > 800  # 8 kHz G.711: one byte per sample


async def test_beta_input_audio_transcription_over_a_raw_websocket(server):
    """Beta `input_audio_transcription` on a raw WebSocket: bad settings get `error` events in shape and
    change nothing; a manual commit is transcribed (beta uses the GA event names for it)."""
    speech = base64.b64encode((8000 * np.sin(np.arange(24000) / 7)).astype("<i2").tobytes()).decode()  # 1 s
    async with websockets.connect(ws_url(server), additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
        await recv_type(ws, "session.created")
        for bad, param in (({"model": "whisper-9"}, "session.input_audio_transcription.model"),
                           ({"language": 5}, "session.input_audio_transcription.language"),
                           ("whisper-1", "session.input_audio_transcription")):
            await ws.send(json.dumps({"type": "session.update", "event_id": "bad",
                                      "session": {"input_audio_transcription": bad}}))
            err = await recv_type(ws, "error")
            assert err["error"]["param"] == param and err["error"]["event_id"] == "bad"
            assert err["error"]["type"] == "invalid_request_error"
        await ws.send(json.dumps({"type": "session.update", "session": {
            "turn_detection": None, "input_audio_transcription": {"model": "whisper-1", "prompt": "a tone"}}}))
        updated = await recv_type(ws, "session.updated")
        assert updated["session"]["input_audio_transcription"] == {"model": "whisper-1", "language": None,
                                                                   "prompt": "a tone"}
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": speech}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        item_id = (await recv_type(ws, "input_audio_buffer.committed"))["item_id"]
        events = [await recv(ws)]
        while events[-1]["type"] != "conversation.item.input_audio_transcription.completed":
            events.append(await recv(ws))
    assert [e["type"] for e in events[:1]] == ["conversation.item.created"]
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert {e["item_id"] for e in deltas} == {item_id} and "".join(e["delta"] for e in deltas) == \
        events[-1]["transcript"]
    assert set(events[-1]) == {"type", "event_id", "item_id", "content_index", "transcript", "usage"}


async def test_transcription_sessions_at_connect_over_a_raw_websocket(server):
    """`?intent=transcription` opens a transcription session (GA: `session.created` of type transcription);
    with `&model=gpt-4o-transcribe` the served model runs under that transcriber's name, and a beta client gets
    `transcription_session.created`. A commit is transcribed, `response.create` is refused, and no response
    event ever comes. Another intent is refused at connect (1008)."""
    base = f"ws://127.0.0.1:{server.port}/v1/realtime"
    async with websockets.connect(f"{base}?intent=transcription") as ws:
        created = await recv(ws)
    assert created["type"] == "session.created" and created["session"]["type"] == "transcription"
    assert created["session"]["audio"]["input"]["transcription"]["model"] == "tiny"
    speech = base64.b64encode((8000 * np.sin(np.arange(24000) / 7)).astype("<i2").tobytes()).decode()  # 1 s
    async with websockets.connect(f"{base}?intent=transcription&model=gpt-4o-transcribe",
                                  additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
        created = await recv(ws)
        assert created["type"] == "transcription_session.created"
        assert created["session"]["input_audio_transcription"]["model"] == "gpt-4o-transcribe"
        await ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": None}}))
        assert (await recv(ws))["type"] == "transcription_session.updated"
        for event in ({"type": "input_audio_buffer.append", "audio": speech}, {"type": "input_audio_buffer.commit"},
                      {"type": "response.create", "event_id": "evt_r"}):
            await ws.send(json.dumps(event))
        events = [await recv(ws)]
        while {"error", "conversation.item.input_audio_transcription.completed"} - {e["type"] for e in events}:
            events.append(await recv(ws))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["input_audio_buffer.committed", "conversation.item.created"]
    assert not [k for k in kinds if k.startswith("response.")]
    error = events[kinds.index("error")]["error"]
    assert (error["code"], error["event_id"]) == ("unsupported_event", "evt_r")
    async with websockets.connect(f"{base}?intent=translation") as ws:
        err = await recv(ws)
        assert err["type"] == "error" and err["error"]["param"] == "intent"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws)
        assert closed.value.rcvd.code == 1008


MALFORMED = [
    ("bad json", '{"type": "session.update", ', "invalid_json", None),
    ("not an object", "[1, 2]", "invalid_event", None),
    ("unknown type", {"type": "session.explode"}, "invalid_event_type", "type"),
    ("wrong field type", {"type": "input_audio_buffer.append", "audio": 123}, "invalid_type", "audio"),
    ("wrong nested type", {"type": "session.update", "session": {"instructions": 5}}, "invalid_type",
     "session.instructions"),
    ("missing field", {"type": "conversation.item.truncate", "item_id": "x", "content_index": 0}, None,
     "audio_end_ms"),
    ("invalid base64", {"type": "input_audio_buffer.append", "audio": "@@@not base64@@@"}, "invalid_base64", "audio"),
    ("audio of the wrong format", {"type": "input_audio_buffer.append",
                                   "audio": base64.b64encode(b"\x01\x02\x03").decode()}, "invalid_audio_format",
     "audio"),
    ("unknown item", {"type": "conversation.item.delete", "item_id": "item_nope"}, "item_not_found", "item_id"),
    ("unsupported voice", {"type": "session.update", "session": {"voice": "nobody"}}, "invalid_voice", None),
    ("unserved field at a value", {"type": "session.update", "session": {"audio": {"output": {"speed": 1.5}}}},
     "unsupported_parameter", "session.audio.output.speed"),
    ("a tool without a name", {"type": "response.create", "response": {"tools": [{"type": "function"}]}},
     "invalid_value", "response.tools.0.name"),
    ("a tool schema that is not JSON Schema", {"type": "session.update", "session": {"tools": [
        {"type": "function", "name": "f", "parameters": {"type": "objekt"}}]}}, "invalid_schema",
     "session.tools.0.parameters"),
    ("tool_choice naming no tool", {"type": "response.create", "response": {"tool_choice": {
        "type": "function", "name": "nope"}}}, "invalid_value", "response.tool_choice"),
    ("a function_call_output of no call", {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "call_nope", "output": "{}"}}, "invalid_value", "item.call_id"),
    ("a function_call_output without output", {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "call_1"}}, "missing_required_parameter", "item.output"),
    ("a function_call_output with content", {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "call_1", "output": "1", "content": []}}, "unknown_parameter",
     "item.content"),
    ("unknown field", {"type": "response.create", "response": {"temprature": 0.5}}, "unknown_parameter",
     "response.temprature"),
    ("unknown event field", {"type": "response.cancel", "response": "resp_1"}, "unknown_parameter", "response"),
    ("unknown item field", {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "hi", "cache_control": {}}]}}, "unknown_parameter",
     "item.content.0.cache_control"),
    ("cancel without response", {"type": "response.cancel"}, "response_cancel_not_active", None),
    ("oversized event", {"type": "input_audio_buffer.append", "audio": "A" * 70000}, "event_too_large", None),
]


async def test_malformed_events_get_errors_and_the_session_goes_on(limited):
    async with websockets.connect(ws_url(limited), max_size=None) as ws:
        assert (await recv(ws))["type"] == "session.created"
        for i, (name, event, code, param) in enumerate(MALFORMED):
            if isinstance(event, dict):
                event = json.dumps({**event, "event_id": f"evt_{i}"})
            await ws.send(event)
            err = await recv(ws)
            assert err["type"] == "error", name
            detail = err["error"]
            assert detail["message"] and detail["type"] == "invalid_request_error", name
            assert code is None or detail["code"] == code, (name, detail)
            assert param is None or detail["param"] == param, (name, detail)
            if code not in ("invalid_json", "invalid_event", "event_too_large"):
                assert detail["event_id"] == f"evt_{i}", name
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
        updated = await recv(ws)
        assert updated["type"] == "session.updated" and updated["session"]["instructions"] == "Be brief."


async def test_input_buffer_limit(limited):
    async with websockets.connect(ws_url(limited), max_size=None) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
        await recv_type(ws, "session.updated")
        second = base64.b64encode(b"\x00\x01" * 24000).decode()  # 1 s of pcm16 (48 KB, under the event limit)
        for _ in range(3):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
        err = await recv_type(ws, "error")
        assert err["error"]["code"] == "input_audio_buffer_full"
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        assert (await recv(ws))["type"] == "input_audio_buffer.cleared"


async def test_session_limit_and_unknown_model_close_at_connect(limited):
    async with websockets.connect(ws_url(limited, "gpt-9")) as ws:
        err = await recv(ws)
        assert err["type"] == "error" and err["error"]["code"] == "model_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws)
        assert closed.value.rcvd.code == 1008
    async with websockets.connect(ws_url(limited)) as a, websockets.connect(ws_url(limited)) as b:
        await recv_type(a, "session.created")
        await recv_type(b, "session.created")
        async with websockets.connect(ws_url(limited)) as c:
            err = await recv(c)
            assert err["type"] == "error" and err["error"]["code"] == "session_limit_reached"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await recv(c)
            assert closed.value.rcvd.code == 1013
    for _ in range(int(HANG_GUARD_S / 0.1)):  # the two sessions' slots come back once they close
        try:
            async with websockets.connect(ws_url(limited)) as d:
                if (await recv(d))["type"] == "session.created":
                    break
        except websockets.ConnectionClosed:
            pass
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("no session admitted after the others closed")


async def test_idle_timeout(limited):
    async with websockets.connect(ws_url(limited)) as ws:
        await recv_type(ws, "session.created")
        err = await recv(ws, timeout=HANG_GUARD_S)  # at the 5 s idle timeout; the guard only ends a hang
        assert err["type"] == "error" and err["error"]["code"] == "session_idle_timeout"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws, timeout=HANG_GUARD_S)
        assert closed.value.rcvd.code == 1000


async def test_a_response_the_engine_refuses_fails_and_the_session_goes_on(server):
    async with websockets.connect(ws_url(server)) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}))
        await ws.send(json.dumps({"type": "response.create", "event_id": "evt_bad",
                                  "response": {"talker_sampling": {"top_p": 7}}}))
        err = await recv_type(ws, "error")
        assert err["error"]["code"] == "invalid_request" and "top_p" in err["error"]["message"]
        done = await recv_type(ws, "response.done")
        assert done["response"]["status"] == "failed" and done["response"]["status_details"]["error"]["message"]
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 3,
                                                                          "output_modalities": ["text"]}}))
        done = await recv_type(ws, "response.done")
        assert done["response"]["status"] in ("completed", "incomplete")


async def test_item_order_and_delete_shape_the_history(server):
    async def answer(ws) -> dict:
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"],
                                                                          "max_output_tokens": 2}}))
        return (await recv_type(ws, "response.done"))["response"]

    def text_item(item_id: str, text: str) -> dict:
        return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    async with websockets.connect(ws_url(server)) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": text_item("b", "second")}))
        await ws.send(json.dumps({"type": "conversation.item.create", "previous_item_id": "root",
                                  "item": text_item("a", "first " * 20)}))
        added = await recv_type(ws, "conversation.item.added")
        added = await recv_type(ws, "conversation.item.added")
        assert added["item"]["id"] == "a" and added["previous_item_id"] is None
        with_a = (await answer(ws))["usage"]["input_tokens"]
        await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "a"}))
        assert (await recv_type(ws, "conversation.item.deleted"))["item_id"] == "a"
        without_a = (await answer(ws))["usage"]["input_tokens"]
        assert with_a - without_a >= 20  # the 20 words of item "a" left the Thinker's prompt


async def test_per_response_instructions_voice_and_out_of_band(server):
    async def answer(ws, **response) -> tuple[dict, bytes]:
        await ws.send(json.dumps({"type": "response.create", "response": {
            "conversation": "none", "max_output_tokens": 4, "talker_sampling": {"max_tokens": 20}, **response}}))
        pcm = bytearray()
        while (ev := await recv(ws))["type"] != "response.done":
            if ev["type"] == "response.output_audio.delta":
                pcm += base64.b64decode(ev["delta"])
        return ev["response"], bytes(pcm)

    async with websockets.connect(ws_url(server)) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}}))
        await recv_type(ws, "conversation.item.done")
        base, base_pcm = await answer(ws)
        again, again_pcm = await answer(ws)  # out-of-band: the conversation did not grow
        assert base["conversation_id"] is None and again["usage"]["input_tokens"] == base["usage"]["input_tokens"]
        assert again_pcm == base_pcm
        voiced, voiced_pcm = await answer(ws, audio={"output": {"voice": "chelsie"}})
        assert voiced["audio"]["output"]["voice"] == "chelsie" and voiced_pcm != base_pcm
        aliased, aliased_pcm = await answer(ws, audio={"output": {"voice": "alloy"}})  # OpenAI's name for chelsie
        assert aliased["audio"]["output"]["voice"] == "alloy" and aliased_pcm == voiced_pcm
        told, _ = await answer(ws, instructions="Answer like a pirate, in one short sentence, always.")
        assert told["usage"]["input_tokens"] > base["usage"]["input_tokens"]
        texted, text_pcm = await answer(ws, output_modalities=["text"])
        assert text_pcm == b"" and texted["output"][0]["content"][0]["type"] == "output_text"


async def test_an_audio_item_shorter_than_one_feature_window_is_answered(server):
    """2 ms of audio in an item (the feature extractor's STFT failed on < 25 ms: an internal error)."""
    async with websockets.connect(ws_url(server)) as ws:
        await recv_type(ws, "session.created")
        tiny = base64.b64encode(b"\x10\x00" * 48).decode()  # 48 samples at 24 kHz
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": tiny}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"],
                                                                          "max_output_tokens": 2}}))
        events = await until_done(ws)
    assert not [e for e in events if e["type"] == "error"]
    assert events[-1]["response"]["status"] in ("completed", "incomplete")


async def test_a_client_may_send_back_the_session_it_was_given(server):
    """The one field rule: `session.created`'s session object, sent back whole in `session.update`, is accepted
    (its unserved fields are at values that ask for nothing), in both dialects."""
    for headers in ({}, {"OpenAI-Beta": "realtime=v1"}):
        async with websockets.connect(ws_url(server), additional_headers=headers) as ws:
            created = await recv_type(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": created["session"]}))
            updated = await recv(ws)
            assert updated["type"] == "session.updated", updated
            assert updated["session"] == created["session"], (updated, created)


async def test_openai_model_names_name_the_served_model(server):
    """The Agents SDK connects at ?model=gpt-realtime and repeats the name in every session.update: accepted
    silently, as the served name and other aliases are; only another model is refused. Sessions report the
    served model."""
    async with websockets.connect(ws_url(server, "gpt-realtime")) as ws:
        assert (await recv_type(ws, "session.created"))["session"]["model"] == "tiny"
        for model in ("gpt-realtime", "tiny", "gpt-4o-mini-realtime-preview"):
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "model": model, "instructions": f"Be {model}."}}))
            updated = await recv(ws)
            assert updated["type"] == "session.updated" and updated["session"]["instructions"] == f"Be {model}."
        await ws.send(json.dumps({"type": "session.update", "session": {"model": "gpt-4o", "instructions": "x"}}))
        err = await recv(ws)
        assert (err["type"], err["error"]["param"]) == ("error", "session.model")
    secret = mint_secret(server, None, {"session": {"type": "realtime", "model": "gpt-realtime-2.1"}})
    assert secret["session"]["model"] == "tiny"
    async with websockets.connect(ws_url(server, "gpt-realtime"),
                                  additional_headers={"Authorization": f"Bearer {secret['value']}"}) as ws:
        assert (await recv_type(ws, "session.created"))["session"]["model"] == "tiny"


@pytest.mark.parametrize("beta", [False, True])
async def test_items_are_acknowledged_and_responses_echo_their_metadata(server, beta):
    """What LiveKit's plugin waits for: each item create answered with the item (GA `added` and `done`, beta
    `created`), each delete with `deleted` (an update is a delete and a create under the same id), a refusal
    with the client event's id, and `response.created` with the metadata `response.create` sent."""
    item = {"id": "item_lk1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
    added = ["conversation.item.created"] if beta else ["conversation.item.added", "conversation.item.done"]
    async with websockets.connect(ws_url(server), additional_headers={"OpenAI-Beta": "realtime=v1"} if beta
                                  else {}) as ws:
        await recv_type(ws, "session.created")
        for event in ({"type": "conversation.item.create", "item": item},
                      {"type": "conversation.item.delete", "item_id": "item_lk1"},
                      {"type": "conversation.item.create", "item": {**item, "content": [
                          {"type": "input_text", "text": "Hello"}]}}):
            await ws.send(json.dumps(event))
        acks = [await recv(ws) for _ in range(2 * len(added) + 1)]
        assert [e["type"] for e in acks] == [*added, "conversation.item.deleted", *added]
        assert {e.get("item", {}).get("id") or e.get("item_id") for e in acks} == {"item_lk1"}
        assert acks[-1]["item"]["content"][0]["text"] == "Hello"
        await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": "nope", "event_id": "ev_del"}))
        err = await recv(ws)
        assert (err["type"], err["error"]["code"], err["error"]["event_id"]) == ("error", "item_not_found", "ev_del")
        metadata = {"client_event_id": "response_create_abc"}
        await ws.send(json.dumps({"type": "response.create", "event_id": "response_create_abc", "response": {
            "metadata": metadata, "max_output_tokens": 2, ("modalities" if beta else "output_modalities"): ["text"]}}))
        created = await recv_type(ws, "response.created")
        assert created["response"]["metadata"] == metadata
        assert (await recv_type(ws, "response.done"))["response"]["metadata"] == metadata


async def test_semantic_vad_with_noise_reduction_commits_a_spoken_turn(server, tmp_path):
    """pipecat's example session (GA `audio.input`: semantic_vad and near_field noise reduction) is taken and shown
    back as sent; a spoken sentence over a steady hiss is one turn: speech_started, speech_stopped once the
    sentence is over (Smart Turn, batched in the server), committed; the session sent back whole is accepted."""
    from tests.realtime_helpers import b64_chunks, espeak_utterance

    samples, seconds = espeak_utterance(tmp_path, "What is the weather like in Paris today?")
    samples = samples + np.random.default_rng(0).standard_normal(len(samples)).astype(np.float32) * 0.003
    td = {"type": "semantic_vad", "eagerness": "high", "create_response": False, "interrupt_response": True}
    pauses, chunks = server.metric("omnirt_turn_end_pauses_total"), server.metric("omnirt_denoise_chunks_total")
    async with websockets.connect(ws_url(server)) as ws:
        await recv_type(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": td, "noise_reduction": {"type": "near_field"}}}}}))
        updated = await recv_type(ws, "session.updated")
        assert updated["session"]["audio"]["input"]["turn_detection"] == td
        assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
        for chunk in b64_chunks(samples, chunk_ms=20):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        events = [await recv(ws)]
        while events[-1]["type"] != "input_audio_buffer.committed":
            events.append(await recv(ws))
        kinds = [e["type"] for e in events]
        assert kinds.count("input_audio_buffer.speech_started") == 1, kinds
        stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
        assert (1 + seconds - 1.0) * 1000 < stopped["audio_end_ms"] < (1 + seconds + 0.5) * 1000
        assert server.metric("omnirt_turn_end_pauses_total") > pauses  # the end-of-turn model was asked
        assert server.metric("omnirt_denoise_chunks_total") - chunks >= len(samples) // 480 // 2  # every chunk
        await ws.send(json.dumps({"type": "session.update", "session": updated["session"]}))
        again = await recv_type(ws, "session.updated")
        assert again["session"] == updated["session"]
