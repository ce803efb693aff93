"""The spoken utterances of `omnirt bench realtime --mode converse`: 26 distinct requests of 1-8 s, said by espeak-ng
in different voices, rates and pitches, some in parts with a short pause between (as people pause mid-sentence, but
shorter than the 500 ms that ends a server_vad turn). They ship as 16 kHz FLAC files with a manifest
(`omnirt/loadtest/data/utterances/`), so that every machine sends the same speech, espeak-ng or not;
`python -m omnirt.loadtest.utterances` makes them again (deterministic for one espeak-ng version: 1.51 made these).

The files hold speech and digital-zero pauses only: the bench lays its microphone's noise floor over all it sends
(`--noise-db`)."""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soxr

DIR = Path(__file__).with_name("data") / "utterances"
RATE = 16000  # what the Thinker hears; the bench resamples to the wire's rate
# (voice, words a minute, pitch 0-99): espeak-ng's own voices and variants, men's and women's
VOICES = (("en-us", 165, 50), ("en-gb+f3", 150, 60), ("en-us+m3", 180, 40), ("en-gb-x-rp+f2", 160, 65),
          ("en-gb-scotland", 170, 45), ("en-029+m1", 155, 35), ("en-us+f4", 175, 70), ("en-gb+m7", 145, 30))
PAUSES_S = (0.22, 0.28, 0.34)  # inside an utterance; a server_vad turn ends after 0.5 s
SENTENCES: tuple[tuple[str, ...], ...] = (
    ("Hello, can you hear me?",), ("What time is it over there?",), ("Thanks, that helps.",),
    ("Tell me a joke about penguins.",),
    ("Is it going to rain this afternoon?",), ("What is the weather like in Paris today?",),
    ("Can you recommend a good book", "for a long train ride?"),
    ("I need to set an alarm", "for six thirty tomorrow morning."), ("How many cups are in a litre?",),
    ("Remind me to call my sister", "when I get home."), ("What's the capital of Australia?",),
    ("Play something relaxing, please.",), ("How do I say good morning in Japanese?",),
    ("So I was thinking,", "maybe we could try a new recipe tonight,", "something with lots of vegetables,",
     "and not too spicy."),
    ("My flight lands at nine,", "and I need a taxi from the airport", "to the hotel in the city centre."),
    ("Could you explain how a heat pump works,", "and whether it makes sense for a small flat?"),
    ("I'm planning a trip to Lisbon in May.", "What should I see,", "and how many days do I need?"),
    ("Okay, let me think.", "I want three tickets for Saturday,", "two adults and one child."),
    ("Can you summarise the news from today,", "but keep it short?"),
    ("Yesterday my laptop stopped charging.", "I tried another cable,", "and it still does not work."),
    ("Which is better for running,", "early in the morning,", "or late in the evening after work?"),
    ("Write a short poem about the sea,", "with a happy ending."),
    ("Hmm, I am not sure.", "Could you say that again,", "a little more slowly?"),
    ("What's a good name for a grey cat", "that likes to sleep all day?"),
    ("Please add milk, eggs, bread and coffee", "to my shopping list."),
    ("How far is it from Berlin to Munich by train,", "and how long does it take?"),
)


@dataclass(frozen=True, slots=True)
class Utterance:
    file: str
    text: str
    voice: str
    words_per_minute: int
    pitch: int
    pauses_s: tuple[float, ...]
    seconds: float


def make(index: int, parts: tuple[str, ...]) -> tuple[np.ndarray, Utterance]:
    """Utterance `index`: its parts said in its voice, each trimmed to its speech, joined by the pauses."""
    from omnirt.loadtest.speech import _espeak, _trim

    voice, wpm, pitch = VOICES[index % len(VOICES)]
    pauses = tuple(PAUSES_S[(index + k) % len(PAUSES_S)] for k in range(len(parts) - 1))
    said = []
    for part in parts:
        audio, rate = _espeak(part, ["-v", voice, "-s", str(wpm), "-p", str(pitch)])
        said.append(_trim(soxr.resample(audio, rate, RATE).astype(np.float32)))
    pieces = [said[0]]
    for pause, audio in zip(pauses, said[1:]):
        pieces += [np.zeros(int(pause * RATE), np.float32), audio]
    audio = np.concatenate(pieces)
    return audio, Utterance(f"{index:02d}.flac", " ".join(parts), voice, wpm, pitch, pauses, len(audio) / RATE)


def generate(folder: Path = DIR) -> list[Utterance]:
    """Write every utterance's FLAC and the manifest into `folder`."""
    import soundfile

    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for index, parts in enumerate(SENTENCES):
        audio, meta = make(index, parts)
        soundfile.write(folder / meta.file, audio, RATE, subtype="PCM_16", format="FLAC")
        made.append(meta)
    (folder / "manifest.json").write_text(json.dumps([asdict(u) for u in made], indent=1) + "\n")
    return made


def manifest(folder: Path = DIR) -> list[Utterance]:
    return [Utterance(**{**u, "pauses_s": tuple(u["pauses_s"])})
            for u in json.loads((folder / "manifest.json").read_text())]


@functools.cache
def load(rate: int, max_s: float | None = None) -> tuple[np.ndarray, ...]:
    """The shipped utterances at `rate` Hz (float32 mono), those of at most `max_s` seconds where given."""
    import soundfile

    out = []
    for u in manifest():
        if max_s is None or u.seconds <= max_s:
            audio, src = soundfile.read(DIR / u.file, dtype="float32")
            out.append(soxr.resample(audio, src, rate).astype(np.float32) if rate != src else audio)
    return tuple(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omnirt.loadtest.utterances", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DIR, help="the folder to write")
    made = generate(p.parse_args(argv).out)
    seconds = [u.seconds for u in made]
    print(f"{len(made)} utterances, {min(seconds):.1f}-{max(seconds):.1f} s, {sum(seconds):.0f} s in all")


if __name__ == "__main__":
    main()
