"""Whisper's log-mel features in numpy, for the Smart Turn model (`omnirt/app/audio/turn_end.py`): 80 Slaney mel bins of
a 400-point periodic-Hann STFT, 10 ms hop, over exactly 8 s at 16 kHz, as transformers' `WhisperFeatureExtractor(
feature_size=80, chunk_length=8)` computes them with `do_normalize=True` (tests/test_turn_end.py checks it against
transformers). Written here so that the API process needs neither transformers nor torch; batched, so one call
makes every waiting session's features."""

from __future__ import annotations

import functools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

RATE = 16000
N_FFT, HOP, N_MELS = 400, 160, 80
NUM_SAMPLES = 8 * RATE  # the model's input: the last 8 s of a turn
NUM_FRAMES = NUM_SAMPLES // HOP  # 800


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, np.float64)
    return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * 27.0 / np.log(6.4))


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp((m - 15.0) * np.log(6.4) / 27.0))


@functools.cache
def mel_filters() -> np.ndarray:
    """[N_FFT // 2 + 1, N_MELS] triangles, area-normalised (Slaney)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(RATE / 2), N_MELS + 2))
    fft_hz = np.linspace(0, RATE // 2, N_FFT // 2 + 1)
    slopes = edges[None, :] - fft_hz[:, None]
    down = -slopes[:, :-2] / np.diff(edges)[:-1]
    up = slopes[:, 2:] / np.diff(edges)[1:]
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]


@functools.cache
def _window() -> np.ndarray:
    return np.hanning(N_FFT + 1)[:-1]  # periodic Hann, as torch.hann_window


def fit(audio: np.ndarray) -> np.ndarray:
    """The last 8 s of `audio`, zeros in front where it is shorter (the padding side Smart Turn was trained on)."""
    audio = audio[-NUM_SAMPLES:].astype(np.float32, copy=False)
    return np.pad(audio, (NUM_SAMPLES - len(audio), 0))


def log_mel(batch: np.ndarray) -> np.ndarray:
    """[B, NUM_SAMPLES] 16 kHz audio -> [B, N_MELS, NUM_FRAMES] float32 features."""
    x = batch.astype(np.float32)
    x = (x - x.mean(axis=1, keepdims=True)) / np.sqrt(x.var(axis=1, keepdims=True) + 1e-7)
    padded = np.pad(x.astype(np.float64), ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    frames = sliding_window_view(padded, N_FFT, axis=1)[:, ::HOP]  # [B, NUM_FRAMES + 1, N_FFT]
    power = np.abs(np.fft.rfft(frames * _window(), axis=-1)) ** 2
    mel = np.log10(np.maximum(power @ mel_filters(), 1e-10))[:, :-1]  # the last frame dropped, as Whisper does
    mel = np.maximum(mel, mel.max(axis=(1, 2), keepdims=True) - 8.0)
    return ((mel + 4.0) / 4.0).transpose(0, 2, 1).astype(np.float32)
