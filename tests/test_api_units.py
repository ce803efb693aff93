"""Pieces the HTTP and Realtime APIs share, without a server: the one rule for fields, and audio files through
PyAV (encoded in pieces that make one file; decoded with a bound on their length)."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from omnirt.app.audio.files import CODECS, AudioTooLong, StreamEncoder, decode_file, encode_file
from omnirt.app.audio.pcm import AudioFormatError, encode_wav
from omnirt.app.fields import FieldError, rule

RULE = rule(("model",), ignored=("user",), inert={"logprobs": (None, False), "tools": (None, []),
                                                  "speed": (None, 1.0)})


@pytest.mark.parametrize("body", [{"model": "m", "user": {"any": "thing"}}, {"logprobs": False, "tools": []},
                                  {"speed": 1}, {"logprobs": None, "tools": None}])
def test_fields_that_ask_for_nothing_pass(body):
    RULE.check(body, "request")


@pytest.mark.parametrize("body,param,code", [
    ({"logprobs": True}, "request.logprobs", "unsupported_parameter"),
    ({"logprobs": 0}, "request.logprobs", "unsupported_parameter"),  # 0 is not false
    ({"tools": [{"type": "function"}]}, "request.tools", "unsupported_parameter"),
    ({"speed": 1.25}, "request.speed", "unsupported_parameter"),
    ({"modle": "m"}, "request.modle", "unknown_parameter"),
])
def test_fields_that_ask_for_something_unserved_are_refused_by_name(body, param, code):
    with pytest.raises(FieldError) as err:
        RULE.check(body, "request")
    assert (err.value.param, err.value.code) == (param, code) and f"`{param}`" in err.value.message


def _tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_streamed_pieces_make_one_file_of_the_whole_length(fmt):
    pcm = _tone(2.0)
    encoder = StreamEncoder(fmt, 24000)
    pieces = [encoder.encode(pcm[i:i + 9600]) for i in range(0, len(pcm), 9600)] + [encoder.close()]
    assert sum(1 for p in pieces[:-1] if p) >= len(pieces) - 2  # bytes come out as the audio goes in
    with av.open(io.BytesIO(b"".join(pieces))) as f:
        n = sum(frame.samples for frame in f.decode(audio=0))
        rate = f.streams.audio[0].codec_context.sample_rate
    assert 2.0 <= n / rate <= 2.1, (fmt, n, rate)  # codecs pad to whole frames


def test_flac_and_wav_decode_to_the_samples_and_mp3_close_to_them():
    pcm = _tone(1.0, 16000)
    ref = np.frombuffer(pcm, "<i2") / 32768.0
    for fmt, data in (("wav", encode_wav(pcm, 16000)), ("flac", encode_file(pcm, 16000, "flac"))):
        samples, rate = decode_file(data, fmt, 10)
        assert rate == 16000 and np.abs(samples - ref).max() < 1e-6, fmt
    samples, rate = decode_file(encode_file(pcm, 16000, "mp3"), "mp3", 10)
    delay = int(np.argmax(np.correlate(samples[:4000], ref[:2000], "valid")))  # the encoder's delay
    assert rate == 16000 and np.corrcoef(samples[delay:delay + 12000], ref[:12000])[0, 1] > 0.99


def test_decoding_stops_at_the_length_limit_and_names_bad_files():
    long_mp3 = encode_file(_tone(12.0, 8000), 8000, "mp3")
    with pytest.raises(AudioTooLong, match="longer than the limit of 10 s"):
        decode_file(long_mp3, "mp3", 10)
    for data, fmt in ((encode_wav(_tone(0.2), 24000), "mp3"), (b"not audio" * 40, "wav"), (b"", "flac")):
        with pytest.raises(AudioFormatError, match=f"{fmt} file"):
            decode_file(data, fmt, 10)


def test_the_fields_page_lists_every_ignored_and_unserved_field():
    """docs/api-fields.md names each field the rules ignore or accept only at a value that asks nothing."""
    from omnirt.app.chat import protocol
    from omnirt.app.realtime import config, conversation, transcription

    page = (Path(__file__).resolve().parents[1] / "docs" / "api-fields.md").read_text()
    rules = [m.fields for m in (protocol.ChatRequest, protocol.ChatMessage, protocol.StreamOptions)]
    rules += [config.SESSION_FIELDS, config.RESPONSE_FIELDS, config.AUDIO_INPUT_FIELDS, config.AUDIO_OUTPUT_FIELDS,
              config.VAD_FIELDS, conversation.ITEM_FIELDS, conversation.CONTENT_FIELDS,
              transcription.TRANSCRIPTION_FIELDS]
    names = {name for r in rules for name in (*r.ignored, *r.inert, *r.served)}
    assert names and not [n for n in sorted(names) if f"`{n}`" not in page]
