"""What people send to /v1/chat/completions, through the official openai SDK against a real server: the audio
formats (mp3, opus, aac, flac out, whole or streamed, read back with PyAV; mp3 in), OpenAI's voice names, and
the one rule for fields (ignored ones pass, unserved ones at values that ask for something are refused by
name, unknown ones too)."""

from __future__ import annotations

import base64
import io

import av
import httpx
import numpy as np
import openai
import pytest

from omnirt.app.audio.files import encode_file
from omnirt.app.audio.pcm import encode_wav

MSG = [{"role": "user", "content": "Hello! Tell me something nice."}]
FRAMES = 40  # codec frames per reply (80 ms each), pinned: the streamed reply comes in several chunks
PINNED = {"talker_sampling": {"min_tokens": FRAMES + 1, "max_tokens": FRAMES + 1}}  # + the end token
CONTAINERS = {"mp3": "mp3", "opus": "ogg", "aac": "aac", "flac": "flac", "wav": "wav"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def speak(client, fmt: str, voice: str = "chelsie", **kw):
    return client.chat.completions.create(model="tiny", messages=MSG, modalities=["text", "audio"],
                                          audio={"voice": voice, "format": fmt}, max_tokens=12, extra_body=PINNED, **kw)


def read(data: bytes) -> tuple[str, np.ndarray, int]:
    """(container, mono int16 samples, rate) as FFmpeg reads the file, whatever it claims to be."""
    with av.open(io.BytesIO(data)) as f:
        stream = f.streams.audio[0]
        mono = av.AudioResampler(format="s16", layout="mono")
        parts = [out.to_ndarray().reshape(-1) for frame in f.decode(stream) for out in mono.resample(frame)]
        return f.format.name, np.concatenate(parts), stream.codec_context.sample_rate


@pytest.fixture(scope="module")
def reference(client):
    """The reply as WAV: the samples every other format encodes."""
    r = speak(client, "wav")
    _, samples, rate = read(base64.b64decode(r.choices[0].message.audio.data))
    assert rate == 24000 and len(samples) == FRAMES * 1920 - 555
    return r.choices[0].message.audio.transcript, samples


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_compressed_output_formats(client, reference, fmt):
    transcript, ref = reference
    r = speak(client, fmt)
    audio = r.choices[0].message.audio
    container, samples, rate = read(base64.b64decode(audio.data))
    assert container == CONTAINERS[fmt] and audio.transcript == transcript
    seconds = len(samples) / rate  # lossy codecs pad to their frames (and Opus decodes at 48 kHz)
    assert len(ref) / 24000 - 0.05 <= seconds <= len(ref) / 24000 + 0.2, (fmt, seconds)
    if fmt == "flac":
        assert np.array_equal(samples, ref)  # lossless


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "pcm16", "wav"])
def test_streamed_formats_arrive_in_pieces_that_make_one_file(client, reference, fmt):
    transcript, ref = reference
    pieces, text = [], []
    for chunk in speak(client, fmt, stream=True):
        for choice in chunk.choices:
            audio = choice.delta.audio
            if audio is not None and audio.data:
                assert choice.finish_reason is None
                pieces.append(base64.b64decode(audio.data))
            text.append(audio.transcript or "" if audio else "")
    assert len(pieces) >= 3 and "".join(text) == transcript  # the audio streamed: a piece per engine chunk
    data = b"".join(pieces)
    if fmt in ("pcm16", "wav"):  # raw PCM16 deltas, as OpenAI streams audio
        assert np.array_equal(np.frombuffer(data, "<i2"), ref)
        return
    container, samples, rate = read(data)
    assert container == CONTAINERS[fmt]
    assert len(ref) / 24000 - 0.05 <= len(samples) / rate <= len(ref) / 24000 + 0.2
    if fmt == "flac":
        assert np.array_equal(samples, ref)


def tone(seconds: float, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.2 * np.sin(2 * np.pi * 300 * t) * 32767).astype("<i2").tobytes()


def audio_part(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_mp3_input_is_heard_like_wav(client):
    pcm = tone(1.0)
    tokens = {}
    for fmt, data in (("wav", encode_wav(pcm, 16000)), ("mp3", encode_file(pcm, 16000, "mp3")),
                      ("flac", encode_file(pcm, 16000, "flac"))):
        r = client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [audio_part(data, fmt), {"type": "text", "text": "What is it?"}]}])
        tokens[fmt] = r.usage.prompt_tokens
    assert tokens["wav"] == tokens["flac"] and abs(tokens["mp3"] - tokens["wav"]) <= 1, tokens  # mp3 pads a frame


BAD_AUDIO = [
    ("wav sent as mp3", audio_part(encode_wav(tone(0.5), 16000), "mp3"), "invalid_audio", "not a readable mp3 file"),
    ("not audio at all", audio_part(b"hello world " * 50, "mp3"), "invalid_audio", "mp3"),
    ("ogg in", audio_part(encode_file(tone(0.5), 16000, "opus"), "ogg"), "unsupported_audio_format", "wav, mp3, flac"),
    ("longer than the limit", audio_part(encode_file(tone(301.0, 8000), 8000, "mp3"), "mp3"), "audio_too_long",
     "limit of 300 s"),
]


@pytest.mark.parametrize("name,part,code,message", BAD_AUDIO, ids=[b[0] for b in BAD_AUDIO])
def test_bad_or_oversized_audio_is_a_clear_400(client, name, part, code, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [part]}])
    body = err.value.body
    assert body["code"] == code and message in body["message"] and body["param"].startswith("messages.0.content.0")


def test_openai_voice_names_are_aliases(client, server, reference):
    voices = httpx.get(f"{server.url}/v1/voices", timeout=10).json()
    assert voices["voices"] == ["aiden", "chelsie", "ethan"] and voices["aliases"]["alloy"] == "chelsie"
    assert {"ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar"} <= set(voices["aliases"])
    _, samples, _ = read(base64.b64decode(speak(client, "wav", voice="alloy").choices[0].message.audio.data))
    assert np.array_equal(samples, reference[1])  # alloy is chelsie
    with pytest.raises(openai.BadRequestError) as err:
        speak(client, "wav", voice="nobody")
    assert err.value.body["code"] == "invalid_voice" and "alloy" in err.value.body["message"]


def test_fields_openai_clients_send_are_accepted(client):
    """The ignored list, unserved fields at values that ask for nothing, and a reply sent back as history."""
    r = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=4, user="u-1", metadata={"team": "a"}, store=False,
        service_tier="auto", logprobs=False, frequency_penalty=0, presence_penalty=0.0, tools=[], stop=None,
        response_format={"type": "text"}, stream_options=None, parallel_tool_calls=True, tool_choice="none")
    history = [*MSG, r.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


REFUSED = [
    ("deprecated functions", {"functions": [{"name": "f", "parameters": {}}]}, "functions", "unsupported_parameter"),
    ("logprobs", {"logprobs": True}, "logprobs", "unsupported_parameter"),
    ("stop", {"stop": ["\n"]}, "stop", "unsupported_parameter"),
    ("penalty", {"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
    ("unknown", {"temprature": 0.5}, "temprature", "unknown_parameter"),
    ("unknown in audio", {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav", "speed": 2}},
     "audio.speed", "unknown_parameter"),
    ("unknown in a part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}]},
     "messages.0.content.0.cache", "unknown_parameter"),
    ("a deprecated function call in history", {"messages": [*MSG, {"role": "assistant", "content": None,
                                                                   "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.1.function_call", "unsupported_parameter"),
]


@pytest.mark.parametrize("name,extra,param,code", REFUSED, ids=[r[0] for r in REFUSED])
def test_fields_that_would_change_the_answer_are_refused_by_name(server, name, extra, param, code):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 4,
                                                               **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert f"`{param}`" in err["message"]
