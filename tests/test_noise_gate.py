"""The VAD's noise gate: between turns, a window at the session's own noise floor skips Silero, so that an open
microphone in a quiet room costs no model time; the turns decided stay the model's."""

from __future__ import annotations

import numpy as np
import pytest

from omnirt.app.audio.vad import (
    FLOOR_RISE_DB_S,
    VAD_RATE,
    WINDOW,
    SpeechStarted,
    SpeechStopped,
    VadBatcher,
    VadStream,
)
from omnirt.loadtest.utterances import load
from tests.realtime_helpers import vad_turns


async def _turns(x: np.ndarray, noise_gate_db: float | None) -> tuple[list, VadBatcher]:
    batcher = VadBatcher(noise_gate_db=noise_gate_db)
    return await vad_turns(x, batcher), batcher


def _room(rng: np.random.Generator, x: np.ndarray, db: float) -> np.ndarray:
    return x + rng.standard_normal(len(x)).astype(np.float32) * np.float32(10 ** (db / 20))


def _conversation(utterance: np.ndarray, lead: int) -> np.ndarray:
    """A microphone's stream: a lead of room, the utterance, a pause, the utterance again, then room."""
    quiet = np.zeros(2 * VAD_RATE, np.float32)
    return np.concatenate([np.zeros(lead, np.float32), utterance, quiet, utterance, quiet])


async def test_an_open_microphone_in_a_quiet_room_skips_the_model():
    """Three seconds of a -55 dBFS noise floor (louder than the silence gate): once the model has heard a window of
    it, the rest skip the model; no turn."""
    x = _room(np.random.default_rng(0), np.zeros(3 * VAD_RATE, np.float32), -55)
    events, batcher = await _turns(x, 6.0)
    num_windows = len(x) // WINDOW
    assert events == [] and batcher.num_windows + batcher.num_silent == num_windows
    assert batcher.num_windows <= 2 and batcher.num_silent >= num_windows - 2
    ungated, every = await _turns(x, None)
    assert ungated == [] and every.num_windows == num_windows and every.num_silent == 0


@pytest.mark.parametrize("db", [-55, -60])
async def test_turns_under_a_room_s_noise_floor_stay_the_model_s(db):
    """Shipped utterances (espeak, with pauses) spoken twice into a room at `db` dBFS, at different alignments to the
    window grid: the same turns as without the noise gate; each turn ends on the same sample and starts within a
    window of it (the model's state after the gated windows is that of the room it heard last, and an onset's first
    window within 6 dB of the floor is not asked). At -55 dBFS a third of the windows or more skip the model; at -60
    the silence gate already takes about half of the room's windows, and the noise gate more."""
    rng, gated_windows, all_windows = np.random.default_rng(1), 0, 0
    for i, utterance in enumerate(load(VAD_RATE)[:6]):
        x = _room(rng, _conversation(utterance, VAD_RATE + 97 * i), db)
        (gated, batcher), (every, unbatched) = await _turns(x, 6.0), await _turns(x, None)
        assert [type(e) for e in gated] == [type(e) for e in every] == [SpeechStarted, SpeechStopped] * 2
        for g, e in zip(gated, every):
            if isinstance(g, SpeechStopped):
                assert g == e
            else:
                assert abs(g.onset_sample - e.onset_sample) <= WINDOW
        gated_windows, all_windows = gated_windows + batcher.num_windows, all_windows + unbatched.num_windows
    assert gated_windows < all_windows * (2 / 3 if db == -55 else 1)


async def test_a_loud_room_always_goes_to_the_model():
    """Above the gate's ceiling (-50 dBFS) no window skips the model: the turns are exactly the model's."""
    x = _room(np.random.default_rng(2), _conversation(load(VAD_RATE)[0], VAD_RATE), -45)
    (gated, batcher), (every, _) = await _turns(x, 6.0), await _turns(x, None)
    assert gated == every and len(gated) == 4 and batcher.num_silent == 0


async def test_speech_from_the_first_sample_and_quiet_speech_reach_the_model():
    """No floor is known before the model has heard a window that is not speech, so speech from the first sample is
    the model's; speech 12 dB over the floor is well past the gate's 6 dB and is heard."""
    utterance = load(VAD_RATE)[1]
    rng = np.random.default_rng(3)
    x = _room(rng, np.concatenate([utterance, np.zeros(VAD_RATE, np.float32)]), -55)
    (gated, _), (every, _) = await _turns(x, 6.0), await _turns(x, None)
    assert gated == every and [type(e) for e in gated] == [SpeechStarted, SpeechStopped]
    rms = float(np.sqrt(np.mean(utterance[np.abs(utterance) > 1e-3] ** 2)))
    quiet = _room(rng, _conversation(utterance * np.float32(10 ** (-43 / 20) / rms), VAD_RATE), -55)  # -43 dBFS
    (gated, batcher), (every, _) = await _turns(quiet, 6.0), await _turns(quiet, None)
    assert [type(e) for e in every] == [SpeechStarted, SpeechStopped] * 2
    assert [type(e) for e in gated] == [type(e) for e in every] and batcher.num_silent > 0


def test_the_floor_follows_a_quieter_room_at_once_and_a_louder_one_slowly():
    stream = VadStream()
    stream.hear_floor(0.01)
    stream.hear_floor(0.001)
    assert stream.floor == 0.001  # at once
    for _ in range(VAD_RATE // WINDOW):  # a second of a room 20 dB louder
        stream.hear_floor(0.01)
    assert stream.floor == pytest.approx(0.001 * 10 ** (FLOOR_RISE_DB_S / 20), rel=0.01)
