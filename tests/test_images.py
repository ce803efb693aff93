"""Images in the engine: prompts as the checkpoint's processor makes them (`Qwen3OmniMoeProcessor` from the tiny
checkpoint's files: token ids, pixel patches, grids), greedy text and speech equal to transformers' generate() on
the same weights (vision encoder, deepstack rows, multimodal rope in the Thinker and the Talker), over prefill
chunks that cut through an image, and prefix reuse keyed by the image's pixels."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.qwen3_omni import released
from omnirt.pipeline.models.qwen3_omni.prompt import PromptConfigError
from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model
from tests.test_parity import assert_same_reply, engine_generate, reference_generate, started_engine
from tests.test_prompt import _audio, _copy, _encoder, _NoVideoProcessor


def image(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth random picture (RGB uint8), so that resizing it changes it, as it would a photo."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR))


def _user(*parts) -> dict:
    def part(p):
        if isinstance(p, str):
            return {"type": "text", "text": p}
        return {"type": "image", "image": p} if p.dtype == np.uint8 else {"type": "audio", "audio": p}
    return {"role": "user", "content": [part(p) for p in parts]}


CASES = {
    "image": [_user(image(100, 150, 0), "What is in this picture?")],
    "image_audio_text": [{"role": "system", "content": "You are a helpful voice assistant."},
                         _user(_audio(0.8, 1), "Compare", image(40, 700, 2), "with", image(300, 64, 3)),
                         {"role": "assistant", "content": "The first is wider."}, _user(image(33, 33, 4))],
}


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def processor(checkpoint):
    """transformers' processor from the checkpoint's own files (its image processor from preprocessor_config.json,
    as `Qwen3OmniMoeProcessor.from_pretrained` builds it where torchvision is missing)."""
    template = json.loads((checkpoint / "chat_template.json").read_text())["chat_template"]
    return _NoVideoProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(checkpoint), video_processor=None,
                             feature_extractor=WhisperFeatureExtractor.from_pretrained(checkpoint),
                             tokenizer=AutoTokenizer.from_pretrained(checkpoint), chat_template=template)


def _of(messages, kind: str) -> list:
    return [p[kind] for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == kind]


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_pixels_and_grids_equal_the_released_processors(case, processor, checkpoint):
    messages = CASES[case]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = processor(text=text, images=[Image.fromarray(i) for i in _of(messages, "image")],
                    audio=_of(messages, "audio") or None, return_tensors="pt")
    ours = _encoder(checkpoint).encode(messages)
    assert ours.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"], atol=0, rtol=0)
    merge = processor.image_processor.merge_size
    assert [b - a for a, b in ours.image_spans] == (ref["image_grid_thw"].prod(-1) // merge**2).tolist()
    ids = ours.input_ids
    assert all(ids[a - 1] == processor.tokenizer.convert_tokens_to_ids("<|vision_start|>") for a, _ in ours.image_spans)


def test_the_tiny_model_ships_the_released_image_processor(checkpoint):
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert {k: config[k] for k in released.IMAGE_PROCESSOR} == released.IMAGE_PROCESSOR
    assert config["feature_size"] == released.FEATURE_EXTRACTOR["feature_size"]  # one file, both parts


def test_an_image_processor_that_disagrees_with_the_vision_encoder_fails_at_load(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    config = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**config, "patch_size": 14}))
    with pytest.raises(PromptConfigError, match="patch_size 14 != the vision encoder's 16"):
        _encoder(path)


@pytest.fixture(scope="module")
def chunked(tiny_config):
    """The tiny profile with prefill chunks of at most 16 tokens (they cut through an image's placeholders)."""
    stages = [dataclasses.replace(s, max_num_batched_tokens=16, max_num_seqs=2) for s in tiny_config.stages]
    with started_engine(dataclasses.replace(tiny_config, stages=tuple(stages))) as eng:
        yield eng


PICTURE = [{"role": "system", "content": "You are a helpful assistant."}, _user(image(128, 160, 5), "Describe it.")]


@contextlib.contextmanager
def prompt_logits(engine):
    """The Thinker's logits at the end of each request's prompt, by request id, as its prefill computed them."""
    model, seen = engine.stage("thinker").runner.model, {}
    run = model.run

    def tapped(batch):
        outs = run(batch)
        for r, o in zip(batch.requests, outs):
            if o.logits is not None:
                seen.setdefault(r.request_id, o.logits.float().cpu())
        return outs

    model.run = tapped
    try:
        yield seen
    finally:
        del model.run  # the class's own method again


async def test_an_image_prompt_answers_as_generate_in_text_and_speech(chunked, reference_model):
    """Greedy text tokens, all 16 codebooks of every frame and the waveform are generate()'s: the vision encoder's
    rows, the deepstack rows added after the first decoder layers, the image's rope positions in the Thinker and
    in the Talker (whose prompt rows at the image come from the tapped layer). The prompt is prefilled in chunks
    of 16 tokens, two of which cut through the image's 20 placeholders. The prompt's logits equal the Thinker's
    forward to float rounding: the tiny model's deepstack rows are too small to change a greedy token, not
    those logits (leaving them out moves them by 0.07)."""
    prompt = chunked.models.encoder.encode(PICTURE)
    assert prompt.image_spans and (prompt.image_spans[0][1] - prompt.image_spans[0][0]) == 20
    ref = reference_generate(reference_model, prompt)
    with prompt_logits(chunked) as logits:
        out = await engine_generate(chunked, "image-parity", PICTURE)
    assert_same_reply(chunked, ref, out)
    ids = torch.tensor([prompt.input_ids])
    with torch.inference_mode():
        forward = reference_model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    torch.testing.assert_close(logits["image-parity"], forward.logits[0, -1].float(), atol=2e-6, rtol=0)
    other = [PICTURE[0], _user(image(128, 160, 6), "Describe it.")]  # another picture, the same ids
    assert reference_generate(reference_model, chunked.models.encoder.encode(other)).tokens != ref.tokens


async def _answer(engine, rid: str, messages) -> tuple[list[int], int]:
    req = OmniRequest(rid, messages, thinker_sampling={"temperature": 0.0, "max_tokens": 8})
    reply = await collect_reply(await engine.submit(req))
    return reply.token_ids, reply.finished.usage.cached_tokens


async def test_the_same_image_reuses_a_cached_prefix_and_another_image_does_not(chunked, engine):
    """Two pictures of one size make the same token ids: only the digest of their pixels in the cache key keeps
    the second from taking the first's KV. Each answer is the one a fresh engine without a resident slot gives."""
    first = [_user(image(64, 64, 7), "What is it?")]
    other = [_user(image(64, 64, 8), "What is it?")]
    start = chunked.models.encoder.encode(other).image_spans[0][0]
    tokens, cached = await _answer(chunked, "img-a", first)
    assert cached <= start  # earlier prompts share at most the turn's header
    again = first + [{"role": "assistant", "content": chunked.models.tokenizer.decode(tokens)}, _user("And now?")]
    for rid, messages, reused in (("img-b", again, lambda n: n >= len(chunked.models.encoder.encode(first).input_ids)),
                                  ("img-c", other, lambda n: 0 < n <= start)):
        tokens, cached = await _answer(chunked, rid, messages)
        assert reused(cached), (rid, cached)
        assert tokens == (await _answer(engine, f"{rid}-fresh", messages))[0], rid  # the session engine's slots
        # hold none of these pictures
