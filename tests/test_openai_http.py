"""The official `openai` SDK against a real server on a loopback port, and bad input over raw HTTP."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile

from omnirt.app.audio.pcm import encode_wav

MSG = [{"role": "user", "content": "Hello! Tell me something nice."}]
AUDIO = {"voice": "chelsie", "format": "wav"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(client, server):
    models = client.models.list().data
    assert models[0].id == "tiny" and all(m.object == "model" and m.owned_by == "omnirt" for m in models)
    ids = [m.id for m in models]  # the profile's model_aliases: OpenAI's realtime and audio models
    assert {"gpt-realtime", "gpt-realtime-2025-08-28", "gpt-4o-realtime-preview", "gpt-4o-mini-realtime-preview",
            "gpt-audio", "gpt-4o-audio-preview", "gpt-4o-mini-audio-preview"} <= set(ids) and len(set(ids)) == len(ids)
    assert "gpt-4o" not in ids and not any("*" in i for i in ids)
    assert server.health()["status"] == "ok"


def test_openai_audio_model_names_are_served_unchanged(client):
    """Code written for gpt-4o-audio-preview runs as it is (its voice too); answers name the served model."""
    kw = dict(model="gpt-4o-audio-preview", messages=MSG, modalities=["text", "audio"],
              audio={"voice": "alloy", "format": "wav"}, max_tokens=8)
    r = client.chat.completions.create(**kw)
    assert r.model == "tiny" and r.choices[0].message.audio.data
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks and {c.model for c in chunks} == {"tiny"}


def test_text(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5


def _wav(b64: str) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(b64)), dtype="int16")
    return samples, rate


def test_text_and_audio_non_streaming(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, modalities=["text", "audio"], audio=AUDIO,
                                       max_tokens=16)
    audio = r.choices[0].message.audio
    samples, rate = _wav(audio.data)
    frames = r.usage.completion_tokens_details.audio_tokens
    assert rate == 24000 and frames > 0
    assert len(samples) == frames * 1920 - 555  # every codec frame decoded, no gap at chunk joins
    assert audio.transcript and audio.expires_at > time.time() and audio.id


def test_streaming_audio_equals_non_streaming(client):
    kw = dict(model="tiny", messages=MSG, modalities=["text", "audio"], audio=AUDIO, max_tokens=16)
    whole = client.chat.completions.create(**kw)
    ref, _ = _wav(whole.choices[0].message.audio.data)
    pcm, transcript, usage, finish = bytearray(), [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            delta_audio = choice.delta.audio  # the SDK's ChoiceDeltaAudio
            if delta_audio is not None and delta_audio.data:
                pcm += base64.b64decode(delta_audio.data)
            transcript.append(delta_audio.transcript or "" if delta_audio else "")
            finish = choice.finish_reason or finish
    assert np.array_equal(np.frombuffer(bytes(pcm), "<i2"), ref)
    assert "".join(transcript) == whole.choices[0].message.audio.transcript
    assert usage.completion_tokens == whole.usage.completion_tokens and finish == whole.choices[0].finish_reason


def test_streaming_text(client):
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(model="tiny", messages=MSG, max_tokens=10, stream=True) if c.choices]
    assert "".join(parts) == client.chat.completions.create(model="tiny", messages=MSG,
                                                            max_tokens=10).choices[0].message.content


def test_audio_input_and_multi_turn(client):
    t = np.arange(24000) / 24000
    wav = encode_wav((0.2 * np.sin(2 * np.pi * 300 * t) * 32767).astype("<i2").tobytes(), 24000)
    messages = [
        {"role": "user", "content": [{"type": "input_audio",
                                      "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                                     {"type": "text", "text": "What did you hear?"}]},
        {"role": "assistant", "content": "A tone."},
        {"role": "user", "content": "Describe it again."},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert r.usage.prompt_tokens > 20  # the 1 s of audio became ~13 audio tokens plus three turns
    details = r.usage.prompt_tokens_details  # 1 s: 100 mel frames, 13 audio encoder frames, one token each
    assert (details.audio_tokens, details.image_tokens) == (13, 0)
    assert details.text_tokens == r.usage.prompt_tokens - 13
    text_only = client.chat.completions.create(model="tiny", messages=messages[2:], max_tokens=1).usage
    assert text_only.prompt_tokens_details.audio_tokens == 0
    assert text_only.prompt_tokens_details.text_tokens == text_only.prompt_tokens


def test_a_resent_history_reports_the_tokens_it_did_not_prefill_again(client):
    """A client that resends the conversation gets the KV of the part the server still holds reused, and
    told so in `prompt_tokens_details.cached_tokens`."""
    messages = [{"role": "user", "content": "Name three rivers of Europe, please."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And three mountains?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


BAD = [
    ("malformed json", b'{"model": "tiny", "messages": [', 400, None),
    ("unknown model", {"model": "gpt-9", "messages": MSG}, 404, "model_not_found"),
    ("unknown voice", {"model": "tiny", "messages": MSG, "modalities": ["text", "audio"],
                       "audio": {"voice": "nobody", "format": "wav"}}, 400, "invalid_voice"),
    ("invalid base64", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}]}]}, 400,
     "invalid_base64"),
    ("not wav", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"hello" * 100).decode(),
                                                "format": "wav"}}]}]}, 400, "invalid_audio"),
    ("prompt too long", {"model": "tiny", "messages": [
        {"role": "user", "content": " ".join(f"w{i}x" for i in range(3000))}]}, 400, "context_length_exceeded"),
    ("messages not a list", {"model": "tiny", "messages": "hello"}, 400, None),
    ("max_tokens wrong type", {"model": "tiny", "messages": MSG, "max_tokens": "ten"}, 400, None),
    ("temperature out of range", {"model": "tiny", "messages": MSG, "temperature": 9}, 400, None),
    ("audio output without audio params", {"model": "tiny", "messages": MSG, "modalities": ["audio"]}, 400,
     "missing_audio_params"),
    ("unknown role", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
]


@pytest.mark.parametrize("name,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, body, status, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"content-type": "application/json"}, timeout=30,
                   **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "Traceback" not in r.text
    if code:
        assert err["code"] == code
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 4},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_oversized_body_is_413(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"x" * (33 * 2**20),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_client_disconnect_mid_stream_frees_slots(server):
    body = {"model": "tiny", "messages": MSG, "modalities": ["text", "audio"], "audio": AUDIO, "stream": True,
            "max_tokens": 60, "talker_sampling": {"max_tokens": 400, "min_tokens": 400}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"data"' in line:
                break  # first audio delta: now hang up
    h = server.wait_idle()
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0


def test_client_disconnect_non_streaming_frees_slots(server):
    body = {"model": "tiny", "messages": MSG, "modalities": ["text", "audio"], "audio": AUDIO,
            "max_tokens": 60, "talker_sampling": {"max_tokens": 2000, "min_tokens": 2000}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.5)
    h = server.wait_idle()
    assert h["free_slots"] == h["slots"] and h["active_requests"] == 0


def test_reference_engine_serves_the_same_api():
    """The benchmark baseline (transformers' generate() behind the same routes) answers like omnirt."""
    from tests.conftest import ServerProcess

    srv = ServerProcess(["--set", "engine=reference"])
    try:
        assert srv.health()["status"] == "ok"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny", messages=MSG, modalities=["text", "audio"], audio=AUDIO,
                                           max_tokens=8)
        samples, rate = _wav(r.choices[0].message.audio.data)
        frames = r.usage.completion_tokens_details.audio_tokens
        assert rate == 24000 and frames > 0 and len(samples) == frames * 1920 - 555
        with pytest.raises(openai.BadRequestError, match="no constrained decoding"):  # it has no grammar engine
            client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8,
                                           response_format={"type": "json_object"})
    finally:
        srv.stop()


def test_a_wrong_method_a_wrong_path_and_a_form_body_say_so(server):
    r = httpx.get(f"{server.url}/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert r.json()["error"]["message"] == "Method Not Allowed"
    assert httpx.get(f"{server.url}/v1/no-such-route", timeout=30).json()["error"]["message"] == "Not Found"
    r = httpx.post(f"{server.url}/v1/chat/completions", data={"model": "tiny", "messages": "hi"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 415 and err["code"] == "unsupported_media_type", r.text
    assert "Content-Type: application/json" in err["message"] and "application/x-www-form-urlencoded" in err["message"]
    assert httpx.get(f"{server.url}/app.js", timeout=30).status_code == 200  # the demo's files are still served
