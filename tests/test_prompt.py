"""Prompts as the checkpoint makes them (`omnirt/pipeline/models/qwen3_omni/prompt.py`): omnirt's token ids and audio
features equal transformers' `Qwen3OmniMoeProcessor` built from the same checkpoint files (its chat template,
then the processor call), for the tiny model that ships the released template; a checkpoint's own template and
preprocessor config are the ones used, and a checkpoint without them fails at load, saying what is missing; a
Realtime conversation and the same chat-completions request make the same prompt."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer, Qwen3OmniMoeConfig, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnirt.app.server import create_app
from omnirt.app.state import ServerSettings
from omnirt.pipeline.api import RequestError
from omnirt.pipeline.models.qwen3_omni import released
from omnirt.pipeline.models.qwen3_omni.prompt import LruCache, PromptConfigError, PromptEncoder
from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model
from tests.test_truncation import Driver, turn_text

RATE = 16000
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _audio(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * 0.1).astype(np.float32)


def _user(*parts) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else
                                        {"type": "audio", "audio": p} for p in parts]}


CASES = {
    "text": [{"role": "user", "content": "Hello, how are you today?"}],
    "audio": [_user(_audio(1.0, 0), "What is in this audio clip?")],
    "multi_turn": [_user("Tell me a long story."), {"role": "assistant", "content": "The dragon and the knight."},
                   _user(_audio(0.61, 1)), {"role": "assistant", "content": "It sounds like the weather."},
                   {"role": "user", "content": "And then?"}],
    "system": [{"role": "system", "content": "You are a helpful voice assistant. Answer briefly."},
               _user("Compare", _audio(2.3, 2), "with", _audio(0.3, 3))],
    "tools": [{"role": "system", "content": "You are a helpful voice assistant."}, _user(_audio(0.8, 4)),
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}],
}


class _NoVideoProcessor(Qwen3OmniMoeProcessor):
    """The released processor without its video processor (it needs torchvision, which the CPU venv lacks)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def processor(checkpoint):
    """transformers' processor from the checkpoint's own files, read here without omnirt's code."""
    template = json.loads((checkpoint / "chat_template.json").read_text())["chat_template"]
    return _NoVideoProcessor(image_processor=Qwen2VLImageProcessorPil(), video_processor=None,
                             feature_extractor=WhisperFeatureExtractor.from_pretrained(checkpoint),
                             tokenizer=AutoTokenizer.from_pretrained(checkpoint), chat_template=template)


def _encoder(path) -> PromptEncoder:
    thinker_config = Qwen3OmniMoeConfig.from_pretrained(path).thinker_config
    return PromptEncoder.from_checkpoint(path, AutoTokenizer.from_pretrained(path), thinker_config)


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return _encoder(checkpoint)


def _audios(messages: list[dict]) -> list[np.ndarray]:
    return [p["audio"] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p["type"] == "audio"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_token_ids_and_features_equal_the_released_processors(case, processor, encoder):
    messages, tools = CASES[case], TOOLS if case == "tools" else None
    text = processor.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ref = processor(text=text, audio=_audios(messages) or None, return_tensors="pt")
    ours = encoder.encode(messages, tools=tools)
    assert ours.input_ids == ref["input_ids"][0].tolist()
    if ours.input_features is None:
        assert "input_features" not in ref and not _audios(messages)
        return
    assert ours.feature_mask.sum(-1).tolist() == ref["feature_attention_mask"].sum(-1).tolist()
    assert len(ours.audio_spans) == len(_audios(messages))
    for i, audio in enumerate(_audios(messages)):
        # each audio as the processor extracts it alone: in one call it pads them all to the longest, which
        # would make an audio's last frame depend on the other audios of the prompt (and so its cache key)
        alone = processor.feature_extractor(audio, **processor.audio_kwargs, return_tensors="pt").input_features[0]
        n = int(ours.feature_mask[i].sum())
        assert n == alone.shape[-1] and not ours.feature_mask[i, n:].any()
        torch.testing.assert_close(ours.input_features[i, :, :n], alone, atol=0, rtol=0)
        torch.testing.assert_close(ours.input_features[i, :, :n - 1], ref["input_features"][i, :, :n - 1],
                                   atol=1e-6, rtol=0)



class _Counting:
    """The feature extractor, counting its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_conversations_earlier_audio_is_extracted_once(checkpoint):
    """Each turn of a voice conversation carries every earlier turn's audio again: only the new audio is
    extracted (the others' features come from the encoder's cache), and the prompt is the one a fresh encoder
    makes (ids, features, cache key)."""
    cached = _encoder(checkpoint)
    cached.features = _Counting(cached.features)
    conversation = []
    for turn in range(3):
        conversation.append(_user(_audio(0.5 + turn, 10 + turn)))
        ours, fresh = cached.encode(conversation), _encoder(checkpoint).encode(conversation)
        assert ours.input_ids == fresh.input_ids and ours.cache_key == fresh.cache_key
        torch.testing.assert_close(ours.input_features, fresh.input_features, atol=0, rtol=0)
        assert torch.equal(ours.feature_mask, fresh.feature_mask)
        assert cached.features.calls == turn + 1
        conversation.append({"role": "assistant", "content": f"Answer {turn}."})


def test_the_feature_cache_keeps_the_most_recently_used_within_its_bytes():
    cache = LruCache(max_bytes=2500)
    kib = (torch.zeros(256),)  # 1 KiB
    for key in (b"a", b"b"):
        cache.put(key, kib)
    assert cache.get(b"a") is kib  # now the most recent
    cache.put(b"c", kib)
    assert cache.get(b"b") is None and cache.get(b"a") is kib and cache.get(b"c") is kib
    assert len(cache) == 2 and cache.num_bytes == 2048

def test_the_tiny_model_ships_the_released_template_and_feature_extractor(checkpoint, encoder):
    assert encoder.chat_template == released.CHAT_TEMPLATE.read_text()
    saved = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert {k: saved[k] for k in released.FEATURE_EXTRACTOR} == released.FEATURE_EXTRACTOR
    assert encoder.sample_rate == RATE


def test_tools_and_tool_messages_reach_the_template(encoder):
    text = encoder.tokenizer.decode(encoder.encode(CASES["tools"], tools=TOOLS).input_ids)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n</tool_response><|im_end|>" in text


def test_a_system_message_of_text_parts_renders_with_tools_as_its_string(encoder):
    """The released template's `tools` branch adds '\\n\\n' to the system message (a list there fails in
    Jinja): text parts go in as their joined text, the prompt of the same message sent as a string."""
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    as_parts = encoder.encode([{"role": "system", "content": parts}, _user("hi")], tools=TOOLS).input_ids
    as_string = encoder.encode([{"role": "system", "content": "Be brief."}, _user("hi")], tools=TOOLS).input_ids
    assert as_parts == as_string
    assert "Be brief.\n\n# Tools" in encoder.tokenizer.decode(as_parts)


def test_messages_the_template_cannot_render_are_a_request_error(encoder):
    """A system message with audio in it has no string form for the `tools` branch."""
    audio = {"type": "audio", "audio": np.zeros(RATE // 2, dtype=np.float32)}
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}, audio]}, _user("hi")]
    with pytest.raises(RequestError, match="chat template cannot render") as err:
        encoder.encode(messages, tools=TOOLS)
    assert err.value.param == "messages"
    assert encoder.encode(messages).input_ids  # without tools the same messages render
    with pytest.raises(RequestError, match="nothing to answer"):
        encoder.encode([])


def _copy(checkpoint, tmp_path, drop: tuple[str, ...] = ()):
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in checkpoint.iterdir():
        if f.name not in drop and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    return out


def test_a_checkpoints_own_template_and_feature_extractor_are_the_ones_used(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path, drop=("chat_template.json",))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\nsaid: {% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}<|audio_start|><|audio_pad|><|audio_end|>{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    features = WhisperFeatureExtractor(**{**released.FEATURE_EXTRACTOR, "hop_length": 320}).to_dict()
    (path / "preprocessor_config.json").write_text(json.dumps({**features, **released.IMAGE_PROCESSOR}))
    enc = _encoder(path)
    prompt = enc.encode([{"role": "user", "content": "hi"}])
    assert enc.tokenizer.decode(prompt.input_ids) == "<|im_start|>user\nsaid: hi<|im_end|>\n<|im_start|>assistant\n"
    audio = enc.encode([{"role": "user", "content": [{"type": "audio", "audio": _audio(1.0, 5)}]}])
    assert int(audio.feature_mask.sum()) == 50  # 1 s at a 20 ms hop, not the released 10 ms


@pytest.mark.parametrize("drop,names", [
    (("chat_template.json",), "no chat template"),
    (("preprocessor_config.json",), "no preprocessor_config.json"),
])
def test_a_checkpoint_without_its_prompt_config_fails_at_load_saying_what_is_missing(checkpoint, tmp_path, drop,
                                                                                    names):
    with pytest.raises(PromptConfigError, match=names):
        _encoder(_copy(checkpoint, tmp_path, drop=drop))


def test_a_feature_extractor_that_disagrees_with_the_audio_encoder_fails_at_load(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    WhisperFeatureExtractor(**{**released.FEATURE_EXTRACTOR, "feature_size": 80}).save_pretrained(path)
    with pytest.raises(PromptConfigError, match="feature_size 80 != the audio encoder's num_mel_bins 128"):
        _encoder(path)


class _Recorder:
    """The engine, keeping each request it is given (it still serves them)."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def submit(self, req):
        self.requests.append(req)
        return self.engine.submit(req)

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def test_a_realtime_conversation_and_the_same_chat_request_make_the_same_prompt(engine):
    recorder = _Recorder(engine)
    session = Driver(recorder)
    await session.start("auto")
    await session.session.handle_event({"type": "session.update", "session": {"instructions": "Be brief."}})
    first = await session.turn(0)
    await session.turn(1)
    await session.close()
    said = "".join(c.get("text", "") for item in first["output"] for c in item["content"])
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": turn_text(0)},
            *([{"role": "assistant", "content": said}] if said else []), {"role": "user", "content": turn_text(1)}]
    with TestClient(create_app(recorder, ServerSettings()), base_url="http://localhost") as client:
        r = await asyncio.to_thread(client.post, "/v1/chat/completions",
                                    json={"model": "tiny", "messages": chat, "max_tokens": 2})
    assert r.status_code == 200, r.text
    realtime, http = recorder.requests[1], recorder.requests[2]
    encode = engine.models.encoder.encode
    assert encode(realtime.messages).input_ids == encode(http.messages).input_ids
    assert r.json()["usage"]["prompt_tokens"] == len(encode(http.messages).input_ids)
