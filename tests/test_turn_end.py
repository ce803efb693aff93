"""semantic_vad: the numpy Whisper features against transformers', the vendored Smart Turn v3.2 model on real
espeak-ng speech, its batching across sessions, the eagerness levels, the detector's decisions at pauses, and a
mid-sentence pause through a session's input buffer (semantic_vad waits through it, server_vad cuts in)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soxr

from omnirt.app.audio import turn_end
from omnirt.app.audio.log_mel import NUM_SAMPLES, fit, log_mel
from omnirt.app.audio.turn_end import EAGERNESS, SemanticVadConfig, SmartTurn, TurnEndBatcher
from omnirt.app.audio.vad import (
    VAD_RATE,
    WINDOW,
    PauseCandidate,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VadBatcher,
    VadConfig,
)
from omnirt.app.realtime.input_buffer import InputBuffer, TurnEnded, TurnStarted
from tests.realtime_helpers import espeak_utterance

# (cut off mid-sentence, the same sentence finished): espeak-ng says both with a falling end, so the model must
# hear it from the words; these two and their halves score far apart (< 0.05 against > 0.9)
SENTENCES = [("What is the weather like in", "What is the weather like in Paris today?"),
             ("So yesterday I went to the", "So yesterday I went to the market and bought some apples.")]
PAUSED = ("So yesterday I went to the,", "market and bought some apples and a loaf of bread.")


def _speech(tmp_path, text: str, rate: int = VAD_RATE) -> np.ndarray:
    """The spoken text alone, from its first to its last loud sample, at `rate`."""
    audio = espeak_utterance(tmp_path, text)[0]
    loud = np.flatnonzero(np.abs(audio) > 0.02)
    return soxr.resample(audio[loud[0]:loud[-1] + 1], 24000, rate)


def _silence(seconds: float, rate: int = VAD_RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), np.float32)


def test_log_mel_equals_transformers_whisper_features():
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80, chunk_length=8)
    rng = np.random.default_rng(0)
    clips = [fit(rng.standard_normal(n).astype(np.float32) * 0.1) for n in (3 * VAD_RATE, 10 * VAD_RATE)]
    ours = log_mel(np.stack(clips))
    for clip, features in zip(clips, ours):
        ref = extractor(clip, sampling_rate=VAD_RATE, padding="max_length", max_length=NUM_SAMPLES, truncation=True,
                        do_normalize=True, return_tensors="np").input_features[0]
        assert features.shape == (80, 800) and np.abs(features - ref).max() < 1e-4
    short = np.ones(100, np.float32)
    assert len(fit(short)) == NUM_SAMPLES and fit(short)[-100:].all() and not fit(short)[:-100].any()  # zeros first


def test_smart_turn_scores_a_finished_sentence_above_the_same_sentence_cut_off(tmp_path):
    """The real model on real speech: each finished sentence scores above its own first half, and a batch gives each
    turn what it gets alone."""
    model = SmartTurn()
    turns = [np.concatenate([_silence(0.3), _speech(tmp_path, t), _silence(0.2)]) for pair in SENTENCES for t in pair]
    batched = model.complete_probability(turns)
    alone = np.concatenate([model.complete_probability([t]) for t in turns])
    assert np.abs(batched - alone).max() < 1e-4 and ((0 <= batched) & (batched <= 1)).all()
    for cut, finished in batched.reshape(-1, 2):
        assert finished > cut


def test_the_model_file_is_the_pinned_one(monkeypatch):
    monkeypatch.setattr(turn_end, "MODEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        SmartTurn()


async def test_the_batcher_takes_every_waiting_session_in_one_model_call():
    batcher = TurnEndBatcher()
    rng = np.random.default_rng(0)
    turns = [rng.standard_normal(VAD_RATE * (i + 1)).astype(np.float32) * 0.05 for i in range(5)]
    probs = await asyncio.gather(*(batcher.complete_probability(t) for t in turns))
    assert (batcher.num_calls, batcher.num_turns) == (1, 5) and all(0 <= p <= 1 for p in probs)
    await asyncio.gather(*(batcher.complete_probability(t) for t in turns[:3]))
    assert (batcher.num_calls, batcher.num_turns) == (2, 8)


def test_eagerness_levels():
    """OpenAI's maximum timeouts (8 s / 4 s / 2 s; auto is medium); a lower eagerness needs a surer model."""
    assert [SemanticVadConfig(eagerness=e).silence_duration_ms for e in ("low", "medium", "high", "auto")] == \
        [8000, 4000, 2000, 4000]
    assert SemanticVadConfig().level == EAGERNESS["medium"]
    assert EAGERNESS["low"].threshold > EAGERNESS["medium"].threshold > EAGERNESS["high"].threshold
    with pytest.raises(ValueError):
        SemanticVadConfig(eagerness="eager")


def _feed(detector: TurnDetector, probs: list[float]) -> list:
    """Windows of a level that follows the probability (speech loud, silence quiet) through the detector."""
    windows = np.stack([np.full(WINDOW, 0.3 if p > 0.5 else 0.0, np.float32) for p in probs])
    return detector.decide(windows, np.array(probs, np.float32))


def test_a_pause_is_offered_to_the_model_once_and_ends_the_turn_when_it_is_sure():
    cfg = SemanticVadConfig()  # medium: asked after 200 ms, 4 s at most
    candidate_windows = -(-cfg.candidate_pause_ms * VAD_RATE // 1000 // WINDOW)
    detector = TurnDetector(cfg)
    events = _feed(detector, [0.9] * 20 + [0.0] * candidate_windows)
    (started, candidate) = events
    assert isinstance(started, SpeechStarted) and isinstance(candidate, PauseCandidate)
    assert candidate.end_sample == 20 * WINDOW and candidate.at_sample == detector.position
    assert detector.resolve(candidate, 0.2) is None and detector.is_speaking  # not finished: keeps listening
    assert _feed(detector, [0.0] * 10) == []  # the same pause is not offered again
    assert detector.resolve(candidate, 0.9) == SpeechStopped(20 * WINDOW, detector.position)
    assert not detector.is_speaking

    detector = TurnDetector(cfg)
    first = _feed(detector, [0.9] * 20 + [0.0] * candidate_windows)[-1]
    again = _feed(detector, [0.9] * 5 + [0.0] * candidate_windows)  # speech resumed: a new pause, a new candidate
    assert detector.resolve(first, 0.99) is None  # a stale answer ends nothing
    assert isinstance(again[-1], PauseCandidate) and again[-1].end_sample == (25 + candidate_windows) * WINDOW
    timeout_windows = cfg.silence_duration_ms * VAD_RATE // 1000 // WINDOW + 1
    stopped = _feed(detector, [0.0] * timeout_windows)  # unsure all along: the eagerness's longest pause ends it
    assert [type(e) for e in stopped] == [SpeechStopped] and stopped[0].end_sample == again[-1].end_sample


async def _turns(x: np.ndarray, cfg) -> list:
    buf, events = InputBuffer(30.0, cfg, VadBatcher()), []
    for i in range(0, len(x), 480):  # 20 ms chunks of 24 kHz
        events += await buf.append(x[i:i + 480], 24000)
    return events


async def test_semantic_vad_waits_through_a_mid_sentence_pause_that_server_vad_cuts(tmp_path):
    """"So yesterday I went to the, [700 ms] market and bought ...": server_vad with 500 ms of silence commits at
    the pause and again at the end; semantic_vad commits once, after the real end, with the whole sentence."""
    first, second = (_speech(tmp_path, t, 24000) for t in PAUSED)
    x = np.concatenate([_silence(0.5, 24000), first, _silence(0.7, 24000), second, _silence(2.0, 24000)])
    end_ms = (0.5 + 0.7) * 1000 + (len(first) + len(second)) / 24
    server = await _turns(x, VadConfig(silence_duration_ms=500))
    semantic = await _turns(x, SemanticVadConfig())
    assert [type(e) for e in server] == [TurnStarted, TurnEnded] * 2
    assert server[1].audio_end_ms < end_ms - 1000  # cut in at the pause
    assert [type(e) for e in semantic] == [TurnStarted, TurnEnded]
    assert end_ms - 100 < semantic[1].audio_end_ms < end_ms + 300  # the end of the speech, not a timeout
    assert len(semantic[1].audio) / VAD_RATE > (len(first) + len(second)) / 24000 + 0.7
