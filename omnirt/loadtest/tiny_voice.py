"""What the built-in tiny model's voice is, measured through the API (the README's "The tiny model" quotes it).

Asks a running server for spoken replies (3 voices x 3 prompts, `pcm16`, the profile's default lengths) and prints,
per reply and over them all: the DC offset (the mean, in full scale), the swing around it, the share of negative
samples, zero crossings a second, and how the energy (offset removed) falls in 2 kHz bands. Only the standard
library and numpy: it runs in the virtualenv `make serve` sets up.

    python -m omnirt.loadtest.tiny_voice [http://127.0.0.1:8091]
"""

from __future__ import annotations

import base64
import json
import sys
import urllib.request

import numpy as np

VOICES = ("ethan", "chelsie", "aiden")
PROMPTS = ("Hi!", "What is the weather in Paris?", "Tell me a story about a dragon.")
RATE = 24000  # pcm16: 24 kHz mono


def reply_samples(url: str, voice: str, prompt: str) -> np.ndarray:
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "modalities": ["text", "audio"],
            "audio": {"voice": voice, "format": "pcm16"}}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        audio = json.load(r)["choices"][0]["message"]["audio"]["data"]
    return np.frombuffer(base64.b64decode(audio), "<i2") / 32768


def describe(x: np.ndarray) -> str:
    crossings = np.count_nonzero(np.diff(np.signbit(x))) / (x.size / RATE)
    return (f"{x.size / RATE:5.1f} s, offset {x.mean():+.3f}, swing +-{x.std():.3f}, min {x.min():+.2f}, "
            f"max {x.max():+.2f}, negative {np.mean(x < 0):.1%}, zero crossings {crossings:.0f}/s")


def energy_bands(x: np.ndarray, width_hz: int = 2000) -> str:
    power = np.abs(np.fft.rfft(x - x.mean())) ** 2
    freqs = np.fft.rfftfreq(x.size, 1 / RATE)
    return ", ".join(f"{lo // 1000}-{(lo + width_hz) // 1000} kHz "
                     f"{power[(freqs >= lo) & (freqs < lo + width_hz)].sum() / power.sum():.0%}"
                     for lo in range(0, RATE // 2, width_hz))


def main(argv: list[str]) -> None:
    url = (argv[0] if argv else "http://127.0.0.1:8091").rstrip("/").removesuffix("/v1")
    replies = []
    for voice in VOICES:
        for prompt in PROMPTS:
            replies.append(reply_samples(url, voice, prompt))
            print(f"{voice:8s} {prompt[:14]:14s} {describe(replies[-1])}")
    everything = np.concatenate(replies)
    print(f"all      {'':14s} {describe(everything)}")
    print(f"energy by band (offset removed): {energy_bands(everything)}")


if __name__ == "__main__":
    main(sys.argv[1:])
