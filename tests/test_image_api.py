"""Images through the APIs against a real server, with the official `openai` SDK: an `image_url` data URL in chat
completions and an `input_image` in a Realtime conversation item reach the model (the prompt counts the image's
placeholders, the answer is the in-process engine's for the same messages); each bad image (a fetched URL, a
malformed data URL, undecodable data, an unsupported format, too many bytes, pixels or images) gets a clear
error in the protocol's shape, and the session goes on. Field by field: tests/test_fuzz.py, test_realtime_fuzz.py."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from PIL import Image

from omnirt.app.images import ImageError, ImageLimits, decode_data_url
from omnirt.pipeline.api import OmniRequest, collect_reply
from tests.conftest import ServerProcess
from tests.fuzz_helpers import IMAGE_URLS, data_url
from tests.realtime_helpers import collect_until
from tests.test_images import image

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
PICTURE = image(96, 128, 11)
URL = data_url(Image.fromarray(PICTURE))
BAD = {  # url -> the error code it gets
    "https://example.com/cat.png": "image_url_not_supported",
    "data:image/png,rawbytes": "invalid_image_url",
    "data:image/png;base64,@@@": "invalid_base64",
    IMAGE_URLS[9]: "unsupported_image_format",  # a BMP, so named
    IMAGE_URLS[10]: "unsupported_image_format",  # a BMP named image/png
    IMAGE_URLS[11]: "invalid_image",  # a truncated JPEG
    IMAGE_URLS[12]: "image_too_large",  # 20 Mpx in a few KB, refused from its header
    "data:image/jpeg;base64,aGVsbG8=": "invalid_image",
}


@pytest.fixture(scope="module")
def small_server():
    """Limits small enough to reach: 2 images a request, 64 KiB an image, 100 x 100 pixels."""
    srv = ServerProcess(["--max-images", "2", "--max-image-bytes", "65536", "--max-image-pixels", "10000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _image_message(url: str, text: str = "What is in this picture?", detail: str = "low") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": detail}},
                                        {"type": "text", "text": text}]}


async def _engine_answer(engine, messages, max_tokens: int) -> tuple[str, int]:
    req = OmniRequest("image-api-ref", messages, thinker_sampling={"temperature": 0.0, "max_tokens": max_tokens})
    reply = await collect_reply(await engine.submit(req))
    return reply.text, reply.finished.usage.prompt_tokens


async def test_a_chat_image_reaches_the_model(client, engine):
    reply = client.chat.completions.create(model="tiny", messages=[SYSTEM, _image_message(URL)], max_tokens=8,
                                           temperature=0)
    engine_messages = [SYSTEM, {"role": "user", "content": [{"type": "image", "image": PICTURE},
                                                            {"type": "text", "text": "What is in this picture?"}]}]
    text, prompt_tokens = await _engine_answer(engine, engine_messages, 8)
    n_image = sum(b - a for a, b in engine.models.encoder.encode(engine_messages).image_spans)
    assert n_image == 12 and reply.usage.prompt_tokens == prompt_tokens  # 96 x 128 px: 3 x 4 merged patches
    details = reply.usage.prompt_tokens_details
    assert (details.image_tokens, details.audio_tokens, details.text_tokens) == (12, 0, prompt_tokens - 12)
    assert reply.choices[0].message.content == text


@pytest.mark.parametrize("url,code", sorted(BAD.items()))
def test_a_bad_chat_image_is_a_400_naming_the_part(client, url, code):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[_image_message(url)], max_tokens=2)
    body = err.value.body
    assert body["code"] == code and body["param"] == "messages.0.content.0.image_url.url", body
    assert body["type"] == "invalid_request_error" and "Traceback" not in body["message"]


def test_images_only_in_user_messages_and_detail_is_checked(client):
    part = {"type": "image_url", "image_url": {"url": URL}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": [part]},
                                                              _image_message(URL)])
    assert err.value.body["param"] == "messages.0.content.0"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[_image_message(URL, detail="ultra")])
    assert err.value.body["param"] == "messages.0.content.0.image_url.detail"
    assert client.chat.completions.create(model="tiny", messages=[_image_message(URL)], max_tokens=2).choices


def test_the_limits_are_the_servers_flags(small_server):
    client = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    tiny_image = data_url(Image.fromarray(image(64, 64, 1)))
    cases = [([_image_message(URL)], "image_too_large", "messages.0.content.0.image_url.url"),  # 12288 px > 10000
             ([_image_message(tiny_image)] * 3, "too_many_images", "messages.2.content.0"),
             ([_image_message(data_url(Image.fromarray(np.random.default_rng(0).integers(  # 75 KiB of noise
                 0, 256, (160, 160, 3), dtype=np.uint8))))], "image_too_large", "messages.0.content.0.image_url.url")]
    for messages, code, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert (err.value.body["code"], err.value.body["param"]) == (code, param), err.value.body
    assert client.chat.completions.create(model="tiny", messages=[_image_message(tiny_image)] * 2, max_tokens=2)


def test_transparency_is_composited_on_white_as_the_released_processor_does():
    rgba = np.zeros((8, 8, 4), dtype=np.uint8)
    rgba[:4, :, :] = (200, 10, 10, 255)  # top half opaque red, bottom half transparent black
    pixels = decode_data_url(data_url(Image.fromarray(rgba, "RGBA")), ImageLimits())
    assert (pixels[:4] == (200, 10, 10)).all() and (pixels[4:] == 255).all()
    with pytest.raises(ImageError, match="not fetched"):
        decode_data_url("HTTPS://example.com/a.png", ImageLimits())


@pytest.fixture(scope="module")
def rt_client(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", websocket_base_url=server.url.replace("http", "ws") + "/v1",
                              api_key="unused", max_retries=0)


def _input_image(url: str, **extra) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url, **extra},
                                                           {"type": "input_text", "text": "What is in this picture?"}]}


async def test_a_realtime_input_image_is_answered_about(rt_client, engine):
    conn = await rt_client.realtime.connect(model="tiny").enter()
    try:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "instructions": SYSTEM["content"],
                                           "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}})
        assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item=_input_image(URL, detail="high"))
        added = await collect_until(conn, lambda ev: ev.type == "conversation.item.done")
        content = added[-1].item.content
        assert content[0].type == "input_image" and content[0].image_url is None  # the bytes are not echoed
        await conn.response.create(response={"max_output_tokens": 8, "temperature": 0.0})
        done = (await collect_until(conn, lambda ev: ev.type == "response.done"))[-1].response
    finally:
        await conn.close()
    messages = [SYSTEM, {"role": "user", "content": [{"type": "image", "image": PICTURE},
                                                     {"type": "text", "text": "What is in this picture?"}]}]
    text, prompt_tokens = await _engine_answer(engine, messages, 8)
    assert done.status in ("completed", "incomplete") and done.usage.input_tokens == prompt_tokens  # 8 tokens
    n_image = sum(b - a for a, b in engine.models.encoder.encode(messages).image_spans)
    details = done.usage.input_token_details
    assert (details.image_tokens, details.audio_tokens, details.text_tokens) == (n_image, 0, prompt_tokens - n_image)
    assert done.output[0].content[0].text == text


async def test_bad_realtime_images_get_error_events_and_the_session_goes_on(rt_client):
    conn = await rt_client.realtime.connect(model="tiny").enter()
    try:
        assert (await conn.recv()).type == "session.created"
        for url, code in BAD.items():
            await conn.conversation.item.create(item=_input_image(url))
            err = (await collect_until(conn, lambda ev: ev.type == "error"))[-1].error
            assert (err.code, err.param) == (code, "item.content.0.image_url"), (url, err)
        await conn.conversation.item.create(item=_input_image(URL, detail="ultra"))
        err = (await collect_until(conn, lambda ev: ev.type == "error"))[-1].error
        assert err.param == "item.content.0.detail"
        await conn.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "system", "content": [{"type": "input_image", "image_url": URL}]}})
        assert (await collect_until(conn, lambda ev: ev.type == "error"))[-1].error.param == "item.content.0.type"
        for _ in range(8):  # the server's limit: 8 images a conversation
            await conn.conversation.item.create(item=_input_image(URL))
            await collect_until(conn, lambda ev: ev.type == "conversation.item.done")
        await conn.conversation.item.create(item=_input_image(URL))
        assert (await collect_until(conn, lambda ev: ev.type == "error"))[-1].error.code == "too_many_images"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Still there?"}]})
        assert (await collect_until(conn, lambda ev: ev.type == "conversation.item.done"))[-1].item.role == "user"
    finally:
        await conn.close()

