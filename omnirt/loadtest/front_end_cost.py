"""CPU cost of the realtime front end's models, per session, with no server: `python -m omnirt.loadtest.front_end_cost`.

- noise reduction: one session's `Denoiser` (24 kHz in, 48 kHz RNNoise, the far_field mix) on 20 ms chunks of the
  bench's utterance under noise: µs per 20 ms chunk, and the share of a core one session takes;
- semantic_vad: Smart Turn v3.2 on 8 s turns (the features and the model), per candidate pause, in batches of
  1 and `--batch` (one call of `TurnEndBatcher` for that many sessions);
- Silero, for scale: one 32 ms window, alone and in a batch of `--batch` sessions.

Each figure is the median of `--repeats` runs of one thread (onnxruntime on one thread, as the server runs it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from omnirt.app.audio.denoise import Denoiser
from omnirt.app.audio.turn_end import SmartTurn
from omnirt.app.audio.vad import WINDOW, SileroBatch, VadStream
from omnirt.loadtest.realtime_mic import CHUNK_S, RATE, utterance


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def denoise_us_per_chunk(kind: str, audio: np.ndarray, repeats: int) -> float:
    chunk = int(RATE * CHUNK_S)
    chunks = [audio[i:i + chunk] for i in range(0, len(audio) - chunk + 1, chunk)]

    def run():
        d = Denoiser(kind)
        for c in chunks:
            d(c, RATE)

    return _median_s(run, repeats) / len(chunks) * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omnirt.loadtest.front_end_cost", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="sessions per batched call")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    speech = utterance(None)[0]
    audio = np.concatenate([np.zeros(RATE // 2, np.float32), speech, np.zeros(RATE // 2, np.float32)])
    audio += np.random.default_rng(0).standard_normal(len(audio)).astype(np.float32) * 0.01
    print("| what | cost | per session |\n|---|---|---|")
    for kind in ("near_field", "far_field"):
        us = denoise_us_per_chunk(kind, audio, args.repeats)
        share = us * 1e-6 / CHUNK_S * 100
        print(f"| noise reduction {kind}, 20 ms chunk of 24 kHz | {us:.0f} µs | {share:.1f} % of a core while audio "
              "flows |")
    model, turn = SmartTurn(), np.resize(speech, 8 * 16000)
    for b in (1, args.batch):
        s = _median_s(lambda b=b: model.complete_probability([turn] * b), args.repeats)
        print(f"| Smart Turn, a batch of {b} candidate pause{'s' if b > 1 else ''} | {s * 1e3:.1f} ms | "
              f"{s / b * 1e3:.1f} ms per pause |")
    silero = SileroBatch()
    for b in (1, args.batch):
        streams, windows = [VadStream() for _ in range(b)], np.zeros((b, WINDOW), np.float32)
        s = _median_s(lambda streams=streams, windows=windows: silero.step(streams, windows), args.repeats * 20)
        print(f"| Silero, one 32 ms window for {b} session{'s' if b > 1 else ''} | {s * 1e6:.0f} µs | "
              f"{s / b / (WINDOW / 16000) * 100:.2f} % of a core |")


if __name__ == "__main__":
    main()
