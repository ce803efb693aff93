"""noise_reduction: RNNoise streaming per session (sample positions kept, state per session, noise taken out, far_field
gentler than near_field), batched across sessions, and in a session's input buffer before the VAD."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soxr

from omnirt.app.audio.denoise import DELAY, FRAME, RATE, DenoiseBatcher, Denoiser
from omnirt.app.audio.vad import VadBatcher, VadConfig
from omnirt.app.realtime.input_buffer import InputBuffer, TurnEnded, TurnStarted
from tests.realtime_helpers import LEAD_S, espeak_utterance


def _stream(denoiser: Denoiser, x: np.ndarray, rate: int, chunk: int) -> np.ndarray:
    return np.concatenate([denoiser(x[i:i + chunk], rate) for i in range(0, len(x), chunk)])


def _noisy(tmp_path, snr_db: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """(24 kHz speech with a lead silence, plus white noise `snr_db` below its peak; the noise alone)."""
    speech = espeak_utterance(tmp_path)[0]
    noise = np.random.default_rng(0).standard_normal(len(speech)).astype(np.float32)
    noise *= np.abs(speech).max() * 10 ** (-snr_db / 20) / 3
    return speech + noise, noise


@pytest.mark.parametrize("rate", [24000, 48000, 8000])
def test_positions_are_kept_and_chunking_does_not_matter(tmp_path, rate):
    """Output sample n is input sample n (at 48 kHz), whatever the chunk size: RNNoise's two-frame delay is taken
    off, and the stream holds back less than its delay plus a frame."""
    x = soxr.resample(_noisy(tmp_path)[0], 24000, rate)
    in_20ms, in_7ms = (_stream(Denoiser("near_field"), x, rate, rate * ms // 1000) for ms in (20, 7))
    n = len(x) * RATE // rate
    assert 0 <= n - len(in_20ms) < DELAY + FRAME and np.array_equal(in_20ms, in_7ms[:len(in_20ms)])
    original = soxr.resample(x, rate, RATE)[:len(in_20ms)]
    lags = range(-FRAME, FRAME)
    best = max(lags, key=lambda d: np.dot(in_20ms[FRAME:-FRAME], original[FRAME + d:len(original) - FRAME + d]))
    assert abs(best) <= 2


def test_each_session_has_its_own_state(tmp_path):
    """Two sessions' chunks interleaved give what each gives alone."""
    a, _ = _noisy(tmp_path)
    b = a[::-1].copy()
    alone = [_stream(Denoiser("near_field"), x, 24000, 480) for x in (a, b)]
    da, db, out = Denoiser("near_field"), Denoiser("near_field"), ([], [])
    for i in range(0, len(a), 480):
        out[0].append(da(a[i:i + 480], 24000))
        out[1].append(db(b[i:i + 480], 24000))
    assert all(np.array_equal(np.concatenate(o), ref) for o, ref in zip(out, alone))


def test_noise_is_taken_out_and_far_field_keeps_more_of_the_original(tmp_path):
    """Where there is only noise (the lead silence), near_field leaves far less of it than far_field, and far_field
    less than there was; the speech stays the loudest part."""
    x, noise = _noisy(tmp_path)
    lead = slice(int(0.3 * RATE), int((LEAD_S - 0.1) * RATE))  # after RNNoise settles, before the speech

    def energy(y: np.ndarray) -> float:
        return float(np.mean(np.square(y[lead], dtype=np.float64)))

    before = energy(soxr.resample(x, 24000, RATE))
    near, far = (_stream(Denoiser(kind), x, 24000, 480) for kind in ("near_field", "far_field"))
    assert energy(near) < energy(far) / 4 < before / 4  # 6 dB and more apart
    speech = slice(int(LEAD_S * RATE), len(near))
    assert np.mean(np.square(near[speech])) > 10 * energy(near)


async def test_the_batcher_takes_every_waiting_session_in_one_round():
    batcher = DenoiseBatcher()
    chunks = [np.random.default_rng(i).standard_normal(480).astype(np.float32) * 0.1 for i in range(6)]
    denoisers = [Denoiser("far_field") for _ in chunks]
    out = await asyncio.gather(*(batcher.denoise(d, c, 24000) for d, c in zip(denoisers, chunks)))
    assert batcher._rounds.num_rounds == 1 and batcher.num_chunks == 6 and all(len(o) == 0 for o in out)  # delay


async def test_the_input_buffer_hears_a_noisy_turn_through_the_denoiser(tmp_path):
    """With noise reduction on, the VAD and the turn's audio get the denoised stream: the turn is heard where it is
    spoken, its audio is quieter than the noisy input where only noise was; off again, the plain path."""
    x, _ = _noisy(tmp_path, snr_db=20)
    results = {}
    for kind in (None, "near_field"):
        buf = InputBuffer(30.0, VadConfig(), VadBatcher())
        buf.set_noise_reduction(kind)
        events = [e for i in range(0, len(x), 480) for e in await buf.append(x[i:i + 480], 24000)]
        assert [type(e) for e in events] == [TurnStarted, TurnEnded]
        results[kind] = events
    plain, denoised = results[None], results["near_field"]
    assert abs(plain[0].audio_start_ms - denoised[0].audio_start_ms) <= 64
    # the end no later: under noise louder than the VAD's level gate the probability alone ends the plain turn
    assert plain[1].audio_end_ms - 400 < denoised[1].audio_end_ms <= plain[1].audio_end_ms + 64
    head = slice(0, 16000 * 200 // 1000)  # the prefix padding: noise alone
    assert np.mean(np.square(denoised[1].audio[head])) < np.mean(np.square(plain[1].audio[head])) / 4
    buf.set_noise_reduction(None)
    assert buf.denoiser is None
