"""Long replies streamed with the real-model profiles' chunk settings, against transformers' one-shot code2wav.

A frame's samples depend on the frames of the vocoder's receptive field before it (152 for the tiny
model: 2 sliding-window layers of 72 frames plus the convolutions; 578 for the released one). A window
whose left context covers it decodes exactly what the one-shot decode gives; the profiles' 25 frames
only approximate it, within the bound written down in docs/architecture.md (Parity).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from tests.profiles import load_profile
from tests.test_parity import (
    PROMPTS,
    THINKER_TOKENS,
    CodecTap,
    as_pcm16,
    engine_generate,
    reference_generate,
    started_engine,
)

DEPLOY = Path(__file__).resolve().parents[1] / "omnirt" / "deploy"
REAL_PROFILES = sorted(p.name for p in DEPLOY.glob("qwen3_omni_moe*.yaml"))
LONG_FRAMES = 240  # >= 3 attention windows of the tiny vocoder, < generate()'s 300-frame chunk (one-shot)
# measured on this reply with 25 frames of context: max |error| 2.3e-3 to 6.1e-3 and SNR 46-57 dB over two
# builds of the tiny model's random weights (docs/architecture.md); the bound leaves room for a third
MAX_ABS_ERROR, MIN_SNR_DB = 2e-2, 35.0
ONE_LSB = 1.5 / 32768  # streamed PCM against a float waveform: a rounding step at most


def snr_db(reference: np.ndarray, estimate: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / np.sum((estimate - reference) ** 2)))


def profile_connector(name: str):
    return load_profile(DEPLOY / name, "cpu").connector


CHUNKINGS = {profile_connector(p): p for p in reversed(REAL_PROFILES)}  # each distinct one, named by a profile using it


@pytest.fixture(scope="module")
def streaming_engine(tiny_config):
    """The tiny model streamed with the single-GPU profile's chunk settings, on its fixed ramp (4, 8, 16, then
    25-frame chunks, 25 of context): the profile's adaptive pacing would cut chunks by this machine's pace."""
    connector = profile_connector("qwen3_omni_moe_1gpu.yaml")
    assert (connector.codec_left_context_frames, connector.codec_chunk_frames, connector.codec_chunk_ramp) == (
        25, 25, True)
    connector = dataclasses.replace(connector, codec_chunk_pacing="fixed")
    with started_engine(dataclasses.replace(tiny_config, connector=connector)) as eng:
        yield eng


@pytest.fixture(scope="module")
def long_reply(streaming_engine, reference_model):
    """(generate()'s reply, the engine's, the engine's windows) for a reply of LONG_FRAMES talker steps."""
    prompt = streaming_engine.models.encoder.encode(PROMPTS["text"])
    ref = reference_generate(reference_model, prompt, THINKER_TOKENS, LONG_FRAMES, LONG_FRAMES)
    with CodecTap(streaming_engine) as tap:
        out = asyncio.run(engine_generate(streaming_engine, "long", PROMPTS["text"], THINKER_TOKENS, LONG_FRAMES,
                                          LONG_FRAMES, tap=tap))
    return ref, out, tap.windows["long"]


def one_shot(reference_model, frames: list[list[int]]) -> np.ndarray:
    """transformers' code2wav over the whole utterance in one forward."""
    with torch.inference_mode():
        return reference_model.code2wav(torch.tensor(frames).T[None])[0, 0].numpy()


def test_long_reply_codes_and_waveform_are_generates(long_reply, reference_model, streaming_engine):
    ref, out, _ = long_reply
    window = reference_model.config.code2wav_config.sliding_window
    assert len(out.frames) == len(ref.frames) >= 3 * window
    assert out.frames == ref.frames
    assert out.tokens == [t for t in ref.tokens if t not in streaming_engine.models.thinker.eos_ids]
    assert np.abs(ref.wav - one_shot(reference_model, ref.frames)).max() < 1e-6  # generate()'s is one-shot
    assert len(out.pcm) == len(ref.wav)


def test_streamed_with_25_frames_of_context_is_within_the_documented_bound(long_reply, streaming_engine):
    """Chunks whose window holds the reply from its start are exact; the rest stay within the bound, which
    this reply does approach (the context is far short of the receptive field)."""
    ref, out, windows = long_reply
    code2wav = streaming_engine.models.code2wav
    assert code2wav.receptive_field_frames == 152 > streaming_engine.cfg.connector.codec_left_context_frames
    whole = [w for w in windows if w.num_context == w.first]
    assert len(whole) == 3 and len(windows) > 8  # 4, 8 and 16 frames, then 25-frame chunks
    exact_end = (whole[-1].first + whole[-1].num_new) * code2wav.samples_per_frame - code2wav.tail
    assert np.abs(out.pcm[:exact_end] - as_pcm16(ref.wav[:exact_end])).max() <= ONE_LSB
    error = np.abs(out.pcm - ref.wav).max()
    assert 1e-4 < error < MAX_ABS_ERROR
    assert snr_db(ref.wav, out.pcm) > MIN_SNR_DB


def test_receptive_field_of_the_tiny_and_the_released_vocoder(reference_model):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omnirt.pipeline.models.qwen3_omni.code2wav import receptive_field_frames
    from omnirt.pipeline.models.qwen3_omni.released import ARCHITECTURE

    assert receptive_field_frames(reference_model.code2wav) == 2 * 71 + 10
    with torch.device("meta"):
        released = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**ARCHITECTURE["code2wav"]))
    assert receptive_field_frames(released) == 8 * 71 + 10


def test_start_up_logs_a_context_short_of_the_receptive_field(tiny_config, caplog):
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    short = dataclasses.replace(tiny_config, connector=profile_connector("qwen3_omni_moe.yaml"))
    with caplog.at_level("INFO", logger="omnirt.pipeline.models.qwen3_omni.models"):
        load_models(short, get_platform("cpu"), ("code2wav",))
    assert "25 frames of left context, the vocoder's receptive field is 152" in caplog.text


def stream_offline(code2wav, frames: list[list[int]], connector, left_context: int) -> np.ndarray:
    """The reply's codes chunked as the engine chunks them once the Talker is done (the fixed sizes, or the
    adaptive pacing's full chunks), decoded window by window, joined."""
    connector = dataclasses.replace(connector, codec_left_context_frames=left_context)
    stream = CodecStream.from_config(connector, 0.08)
    stream.frames, stream.input_done = list(frames), True
    pieces = []
    while not stream.is_drained():
        window, n = stream.next_window()
        pieces.append(code2wav.decode([window])[0])
        stream.advance(n)
    return np.concatenate(pieces)


@pytest.mark.parametrize("connector", list(CHUNKINGS), ids=list(CHUNKINGS.values()))
def test_every_profiles_chunking_is_exact_with_the_receptive_field_and_bounded_with_its_own(
        long_reply, reference_model, streaming_engine, connector):
    ref, _, _ = long_reply
    code2wav = streaming_engine.models.code2wav
    full = one_shot(reference_model, ref.frames)
    exact = stream_offline(code2wav, ref.frames, connector, code2wav.receptive_field_frames)
    assert len(exact) == len(full) and np.abs(exact - full).max() < 1e-5
    approx = stream_offline(code2wav, ref.frames, connector, connector.codec_left_context_frames)
    assert np.abs(approx - full).max() < MAX_ABS_ERROR and snr_db(full, approx) > MIN_SNR_DB


def measure() -> None:
    """Print the error of each profile's chunking of the long reply, at its own left context, the vocoder's
    attention window and its receptive field (the figures in docs/architecture.md):
    `python -m tests.test_vocoder_parity`."""
    from omnirt.pipeline.models.qwen3_omni.weights import load_hf_model

    torch.set_num_threads(1)
    reference_model = load_hf_model("tiny", "auto", torch.float32, torch.device("cpu"))[0]
    tiny = load_profile(DEPLOY / "tiny.yaml", "cpu")
    with started_engine(tiny) as engine:
        code2wav = engine.models.code2wav
        ref = reference_generate(reference_model, engine.models.encoder.encode(PROMPTS["text"]), THINKER_TOKENS,
                                 LONG_FRAMES, LONG_FRAMES)
        full = one_shot(reference_model, ref.frames)
        print(f"{len(ref.frames)} frames, peak {np.abs(full).max():.3f}; receptive field "
              f"{code2wav.receptive_field_frames} frames")
        for connector, profile in CHUNKINGS.items():
            for ctx in sorted({connector.codec_left_context_frames, 72, code2wav.receptive_field_frames}):
                out = stream_offline(code2wav, ref.frames, connector, ctx)
                print(f"{profile} chunks: context {ctx:3d}: max |error| {np.abs(out - full).max():.2e}, "
                      f"SNR {snr_db(full, out):.1f} dB")


if __name__ == "__main__":
    measure()
