"""The VAD lag that turn detection alone gives, with no server and no load: `python -m omnirt.loadtest.vad_lag`.

The bench's utterance (`omnirt bench realtime`'s: espeak-ng's phrase, or the synthetic one where espeak-ng is
missing, as on the GPU machine: `--synthetic`; `--wav` for another) is streamed in 20 ms chunks of 24 kHz audio,
as the bench's microphones send it, through the session's path to the VAD (libsoxr's quick quality to 16 kHz,
the turn detector, Silero), once per alignment of the speech to the VAD's 32 ms windows (`--shifts` of them,
spread over one window). The lag is the bench's: from the chunk that holds the last speech sample to the chunk on
which the turn ends, less the 500 ms of silence the VAD waits for. Rows: the detector as it serves (silence by
level or probability) and with the probability alone (`quiet_db=None`), so that a change to the detector is
measured against the other."""

from __future__ import annotations

import argparse

import numpy as np

from omnirt.app.audio.resample import StreamResampler
from omnirt.app.audio.vad import QUIET_DB, SileroBatch, SpeechStopped, TurnDetector, VadConfig, VadStream
from omnirt.loadtest.realtime_mic import CHUNK_S, RATE, SILENCE_MS, utterance
from omnirt.loadtest.stats import cell, summary

LEAD_S = 0.4  # silence before the speech


def _probabilities(model: SileroBatch, stream: VadStream, windows: np.ndarray) -> np.ndarray:
    """One stream's windows, one model call each (the batcher's results for a lone session)."""
    return np.array([model.step([stream], w[None])[0] for w in windows], np.float32)


def lag_ms(speech: np.ndarray, shift: int, quiet_db: float | None, model: SileroBatch) -> float | None:
    """One turn's VAD lag: the speech after LEAD_S and `shift` samples of silence, then silence."""
    chunk = int(RATE * CHUNK_S)
    lead = int(RATE * LEAD_S) + shift
    x = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(2 * RATE, np.float32)])
    last_speech_chunk = (lead + len(speech) - 1) // chunk
    view, detector = StreamResampler(RATE, 16000, "QQ"), TurnDetector(VadConfig(), quiet_db)
    for k in range(len(x) // chunk):
        windows = detector.windows(view(x[k * chunk:(k + 1) * chunk]))
        events = detector.decide(windows, _probabilities(model, detector.stream, windows))
        if any(isinstance(e, SpeechStopped) for e in events):
            return (k - last_speech_chunk) * CHUNK_S * 1000 - SILENCE_MS
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omnirt.loadtest.vad_lag", description=__doc__.splitlines()[0])
    p.add_argument("--wav", help="the utterance (default: the bench's)")
    p.add_argument("--synthetic", action="store_true", help="the bench's synthetic utterance (a machine without "
                   "espeak-ng sends it)")
    p.add_argument("--shifts", type=int, default=32, help="alignments of the speech to the 32 ms window grid")
    args = p.parse_args(argv)
    speech, seconds = utterance(args.wav, args.synthetic)
    model = SileroBatch()
    shifts = np.linspace(0, 32e-3 * RATE, args.shifts, endpoint=False).astype(int)
    print(f"{seconds:.2f} s of speech, {len(shifts)} alignments to the window grid; VAD lag ms")
    print("| silence | p50 / p90 | min | max |\n|---|---|---|---|")
    for label, quiet_db in ((f"level ({QUIET_DB:.0f} dB below the turn's loudest) or probability", QUIET_DB),
                            ("probability alone", None)):
        lags = [lag for s in shifts if (lag := lag_ms(speech, int(s), quiet_db, model)) is not None]
        s = summary(lags)
        print(f"| {label} | {cell(s, ('p50', 'p90'))} | {min(lags, default=0):.0f} | {s['max'] or 0:.0f} |"
              + ("" if len(lags) == len(shifts) else f" ({len(shifts) - len(lags)} turns never ended)"))


if __name__ == "__main__":
    main()
