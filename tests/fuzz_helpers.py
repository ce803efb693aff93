"""What the fuzz tests share: hypothesis strategies for junk values, images (data URLs good and bad) and for
Realtime `session` objects (`session.update`, client secrets), and a server profile that keeps every valid
request cheap (short contexts, few tokens)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from hypothesis import strategies as st
from PIL import Image

CHEAP = json.dumps({"0": {"max_model_len": 160, "default_sampling_params": {"max_tokens": 8}},
                    "1": {"max_model_len": 192, "default_sampling_params": {"max_tokens": 16}}})

leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=12))
junk = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
small_ints = st.sampled_from([-(2**63), -1, 0, 1, 2, 5, 8, 2**31, 2**63, 2**64]) | st.integers(-3, 12)


def sometimes_junk(strategy):
    """Mostly the well-formed value, one draw in eight anything at all."""
    return st.sampled_from(range(8)).flatmap(lambda i: junk if i == 7 else strategy)


text = st.text(max_size=40) | st.sampled_from([2_000, 60_000]).map(lambda n: "x" * n)  # huge, under the limit
fmt = st.sampled_from([{"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcm", "rate": 16000},
                       {"type": "audio/pcmu"}, {"type": "audio/pcma"}, {"type": "wav"}])
modalities = st.sampled_from([["audio"], ["text"], ["text", "audio"], [], ["video"]])
voices = st.sampled_from(["ethan", "chelsie", "nobody", ""])
vad = st.none() | st.fixed_dictionaries({"type": st.sampled_from(["server_vad", "semantic_vad", "bogus"])}, optional={
    "threshold": st.floats(-1, 2), "silence_duration_ms": small_ints, "prefix_padding_ms": small_ints,
    "create_response": st.booleans(), "interrupt_response": st.booleans(),
    "eagerness": st.sampled_from(["low", "medium", "high", "auto"]) | st.text(max_size=6)})
noise_reduction = st.none() | st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["near_field", "far_field", "studio", None])})
opt = st.fixed_dictionaries  # every key optional: st.fixed_dictionaries({}, optional=...)
transcription = st.none() | opt({}, optional={
    "model": sometimes_junk(st.sampled_from(["tiny", "whisper-1", "gpt-4o-transcribe", "whisper-2", ""])),
    "language": sometimes_junk(st.sampled_from(["en", "fr", "zh-Hans", "EN", "english", ""])),
    "prompt": sometimes_junk(text), "delay": st.sampled_from([None, "low"]), "keywords": sometimes_junk(st.just([]))})
tools = st.lists(sometimes_junk(opt({"type": st.just("function"), "name": st.sampled_from(["get_weather", "roll",
                                                                                           "bad name"])},
                                    optional={"description": sometimes_junk(st.text(max_size=8)),
                                              "parameters": sometimes_junk(st.sampled_from([
                                                  {"type": "object", "properties": {"a": {"type": "integer"}}},
                                                  {"type": "objekt"}, {"$ref": "#/nope"}, {}]))})), max_size=2)
tool_choice = st.sampled_from(["auto", "none", "required", "bogus"]) | opt(
    {"type": st.just("function"), "name": st.sampled_from(["get_weather", "nope"])})
session = opt({}, optional={
    "type": sometimes_junk(st.sampled_from(["realtime", "transcription"])), "instructions": sometimes_junk(text),
    "output_modalities": sometimes_junk(modalities), "modalities": sometimes_junk(modalities),
    "voice": sometimes_junk(voices), "turn_detection": sometimes_junk(vad),
    "input_audio_transcription": sometimes_junk(transcription),
    "input_audio_noise_reduction": sometimes_junk(noise_reduction),
    "input_audio_format": sometimes_junk(st.sampled_from(["pcm16", "g711_ulaw", "g711_alaw", "mp3"])),
    "audio": sometimes_junk(opt({}, optional={
        "input": sometimes_junk(opt({}, optional={"format": sometimes_junk(fmt), "turn_detection": sometimes_junk(vad),
                                                  "transcription": sometimes_junk(transcription),
                                                  "noise_reduction": sometimes_junk(noise_reduction)})),
        "output": sometimes_junk(opt({}, optional={"format": sometimes_junk(fmt), "voice": sometimes_junk(voices)}))})),
    "temperature": sometimes_junk(st.floats(allow_nan=True, allow_infinity=True)),
    "max_output_tokens": sometimes_junk(small_ints | st.just("inf")), "tools": sometimes_junk(tools),
    "tool_choice": sometimes_junk(tool_choice)})


def data_url(image: Image.Image, fmt: str = "PNG", media_type: str | None = None) -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:{media_type or 'image/' + fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _truncated(url: str) -> str:
    head, data = url.split(",", 1)
    return f"{head},{base64.b64encode(base64.b64decode(data)[:-40]).decode()}"


_PICTURE = Image.fromarray(np.arange(24 * 40 * 3, dtype=np.uint8).reshape(24, 40, 3))
_GOOD_PNG = data_url(_PICTURE)
# valid images in each format, then each way an image is refused: fetched URLs, not base64, not a data URL, a type
# the processor does not read, truncated data, a header past the pixel limit, bytes that are no image
IMAGE_URLS = [
    _GOOD_PNG, data_url(_PICTURE, "JPEG"), data_url(_PICTURE, "WEBP"), data_url(_PICTURE.convert("RGBA"), "GIF"),
    "https://example.com/cat.png", "http://127.0.0.1/x.jpg", "data:image/png,rawbytes", "data:image/png;base64,@@@",
    "data:text/plain;base64,aGVsbG8=", data_url(_PICTURE, "BMP", "image/bmp"), data_url(_PICTURE, "BMP", "image/png"),
    _truncated(data_url(_PICTURE.resize((400, 240)), "JPEG")), data_url(Image.new("1", (5000, 4000))),  # 20 Mpx
    "data:image/jpeg;base64,aGVsbG8=", "", "cat.png",
]
image_url = st.sampled_from(IMAGE_URLS) | st.text(max_size=12)
details = st.sampled_from(["auto", "low", "high", "ultra", ""])
