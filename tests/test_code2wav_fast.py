"""Code2Wav's fast path on the CPU at tiny size: the convolutions re-expressed (`conv_backend`) and the compiled
decoder decode what transformers' modules decode, window by window and joined across chunks, to the sample."""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
import pytest
import torch

from omnirt.pipeline.models.qwen3_omni.code2wav import Code2WavModel, CodecWindow
from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from tests.test_parity import PROMPTS, assert_same_reply, engine_generate, reference_generate, started_engine

FAST = ["gemm", "channels_last"]  # the compiled decoder: the engine test below (compiling on the CPU takes minutes)
FP32_TOLERANCE = 1e-5  # the same sums in another order, in float32 (samples in [-1, 1])


def codes(num_frames: int, seed: int, codebook_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook_size, (num_frames, 16), generator=g).tolist()


def vocoder(reference_model, conv_backend: str = "native", compiled: bool = False,
            dtype: torch.dtype = torch.float32) -> Code2WavModel:
    module = copy.deepcopy(reference_model.code2wav).to(dtype)
    return Code2WavModel(module, torch.device("cpu"), conv_backend=conv_backend, compile_step=compiled)


@pytest.fixture(scope="module")
def native(reference_model):
    return vocoder(reference_model)


@pytest.fixture(scope="module", params=FAST)
def fast(request, reference_model):
    return vocoder(reference_model, request.param)


def test_fast_path_decodes_a_batch_of_windows_as_the_native_modules_do(native, fast, reference_model):
    size = reference_model.config.code2wav_config.codebook_size
    windows = [CodecWindow(codes(n, n, size), ctx, ctx == 0) for n, ctx in ((4, 0), (29, 25), (50, 25), (17, 9))]
    expected, got = native.decode(windows), fast.decode(windows)
    assert fast.tail == native.tail > 0
    for w, e, g in zip(windows, expected, got, strict=True):
        num_new = len(w.codes) - w.num_context
        assert len(g) == len(e) == num_new * native.samples_per_frame - (native.tail if w.is_first else 0)
        assert np.abs(g - e).max() < FP32_TOLERANCE
    assert max(np.abs(e).max() for e in expected) > 0.05  # audible, not near-silence


def stream(code2wav: Code2WavModel, frames: list[list[int]], initial: int, chunk: int, context: int) -> list:
    s = CodecStream.fixed(initial, chunk, context, ramp=True, frames=list(frames), input_done=True)
    pieces = []
    while not s.is_drained():
        window, n = s.next_window()
        pieces.append(code2wav.decode([window])[0])
        s.advance(n)
    return pieces


def test_fast_path_chunks_join_to_the_one_shot_decode_with_exact_sample_counts(native, fast, reference_model):
    """Chunks of 4, 8, 16, 25, 25... frames with the vocoder's receptive field as left context: every chunk
    has the samples of its frames (the first less the withheld tail, which the next re-emits), and the
    joined stream is the one-shot decode of the whole reply."""
    frames = codes(90, 7, reference_model.config.code2wav_config.codebook_size)
    full = native.decode_full(frames)
    pieces = stream(fast, frames, 4, 25, fast.receptive_field_frames)
    sizes = [4, 8, 16, 25, 25, 12]
    spf, tail = fast.samples_per_frame, fast.tail
    assert [len(p) for p in pieces] == [sizes[0] * spf - tail] + [n * spf for n in sizes[1:]]
    joined = np.concatenate(pieces)
    assert len(joined) == len(full) == len(frames) * spf - tail
    assert np.abs(joined - full).max() < FP32_TOLERANCE


@pytest.mark.parametrize("conv_backend", FAST)
def test_bfloat16_fast_path_stays_within_the_native_bfloat16_error(reference_model, conv_backend):
    """In bf16 the re-expressed convolutions are no further from the float32 decode than transformers' own
    bf16 modules are (rounding in another order, not a new error)."""
    size = reference_model.config.code2wav_config.codebook_size
    windows = [CodecWindow(codes(30, 3, size), 0, True)]
    exact = vocoder(reference_model).decode(windows)[0]
    native_error = np.abs(vocoder(reference_model, dtype=torch.bfloat16).decode(windows)[0] - exact).max()
    fast_error = np.abs(vocoder(reference_model, conv_backend, dtype=torch.bfloat16).decode(windows)[0] - exact).max()
    assert 0 < native_error < 0.05
    assert fast_error < 2 * native_error


def test_engine_with_the_fast_path_streams_generates_waveform(tiny_config, reference_model):
    """The tiny engine with Code2Wav's convolutions as GEMMs, its decoder compiled (and nothing else) and
    adaptive pacing: the reply's codes and its streamed PCM, joined over its chunks, are generate()'s, to the
    int16 step and the sample count."""
    stages = list(tiny_config.stages)
    stages[2] = dataclasses.replace(stages[2], compile="on")
    connector = dataclasses.replace(tiny_config.connector, codec_chunk_pacing="adaptive")
    cfg = dataclasses.replace(tiny_config, conv_backend="gemm", stages=tuple(stages), connector=connector)
    assert not cfg.compiles("thinker", False) and cfg.compiles("code2wav", False)
    with started_engine(cfg) as eng:
        assert eng.models.code2wav.is_compiled
        ref = reference_generate(reference_model, eng.models.encoder.encode(PROMPTS["text"]))
        out = asyncio.run(engine_generate(eng, "fast-path", PROMPTS["text"]))
        assert_same_reply(eng, ref, out)
