"""The chat bench's requests: distinct random prompts of a stated length distribution, the streaming request that
carries one, and what its reply measured (TTFP, RTF, underruns).

A prompt is random sentences of common English words, seeded: no two prompts of a run share more than the system
prompt (a server reuses nothing but that), and a run's seed, printed in its report, draws the same prompts again.
Lengths are whole-prompt tokens (system prompt and chat template included), drawn log-uniformly over [LO, HI]: as
many short prompts as long ones on a log scale, the way chat traffic spreads. Words per token are calibrated once
on the server's own tokenizer (`calibrate`); the tokens each prompt really had come back in its usage.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from omnirt.app.audio.playback import PlaybackClock, pcm16_seconds
from omnirt.app.audio.wire import PCM16

WORDS = """the people time year way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea kid
body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river mountain garden music window bread
light color paper table summer winter apple road ocean forest train letter picture voice song dinner market bridge
quiet bright small large early late happy simple warm cold green blue old young quick slow long short near far
open close make take give find tell ask feel leave call keep begin help show hear play run move live believe bring
happen write sit stand lose pay meet include continue learn lead understand watch follow stop create speak read
spend grow walk win offer remember love consider appear buy wait serve die send expect build stay fall cut
reach""".split()


def parse_lengths(spec: str) -> tuple[int, int]:
    """'160' (every prompt about 160 tokens) or '16-640' (log-uniform between them) -> (lo, hi)."""
    lo, _, hi = spec.partition("-")
    bounds = (int(lo), int(hi or lo))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"prompt length {spec!r}: N or LO-HI tokens, 0 < LO <= HI")
    return bounds


class Prompts:
    """A run's prompts: random text of a length drawn log-uniformly over [lo, hi] tokens, never the same twice."""

    def __init__(self, seed: int, words_for: Callable[[int], int]) -> None:
        self.rng, self.words_for, self.seen = random.Random(seed), words_for, set()

    def length(self, lengths: tuple[int, int]) -> int:
        lo, hi = lengths
        return round(math.exp(self.rng.uniform(math.log(lo), math.log(hi))))

    def next(self, lengths: tuple[int, int]) -> str:
        n = self.words_for(self.length(lengths))
        while (text := sentences(self.rng, n)) in self.seen:
            n += 1  # a repeat, likely only among prompts of a word or two: one word longer ends any run of them
        self.seen.add(text)
        return text


def sentences(rng: random.Random, num_words: int) -> str:
    """`num_words` random words as sentences of 4 to 12 words."""
    out, left = [], num_words
    while left > 0:
        n = min(left, rng.randint(4, 12))
        words = rng.choices(WORDS, k=n)
        out.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        left -= n
    return " ".join(out)


def request_body(args: argparse.Namespace, text: str) -> dict:
    """A streaming chat request for `text`, sampled as the run says (`--temperature` 0: greedy)."""
    body = {"model": args.model, "stream": True, "stream_options": {"include_usage": True},
            "modalities": ["text", "audio"], "audio": {"voice": args.voice, "format": "pcm16"},
            "messages": [{"role": "user", "content": text}], "max_tokens": args.thinker_tokens,
            "temperature": args.temperature}
    if args.temperature > 0:
        body |= {"top_p": args.top_p, "top_k": args.top_k}
    if args.fixed_lengths:
        body["min_tokens"] = args.thinker_tokens
        body["talker_sampling"] = {"max_tokens": args.talker_frames + 1, "min_tokens": args.talker_frames + 1}
    return body


async def calibrate(client: aiohttp.ClientSession, url: str, model: str) -> tuple[int, float]:
    """(prompt tokens of a one-word prompt, tokens a word adds) on this server, for the bench's words."""
    async def count(text: str) -> int:
        async with client.post(f"{url}/v1/chat/completions", raise_for_status=True, json={
                "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}) as r:
            return (await r.json())["usage"]["prompt_tokens"]

    rng = random.Random(0)
    base, long = await count("Hello."), await count(sentences(rng, 200))
    return base, max((long - base) / 199, 1e-3)


def words_for(base: int, per_word: float) -> Callable[[int], int]:
    """tokens -> words: how many of the bench's words make a prompt of that many tokens (at least one)."""
    return lambda tokens: max(1, round(1 + (tokens - base) / per_word))


@dataclass(slots=True)
class Sample:
    ok: bool = False
    ttft_s: float | None = None
    ttfp_s: float | None = None
    latency_s: float = 0.0
    audio_s: float = 0.0
    rtf: float | None = None
    max_gap_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    underruns: int = 0
    prompt_tokens: int = 0
    error: str | None = None


def underruns(arrivals: list[tuple[float, float]]) -> int:
    """arrivals: (time since send, seconds of audio in the packet), through the server's own playback clock."""
    clock = PlaybackClock()
    for t, dur in arrivals:
        clock.on_packet(t, dur)
    return clock.num_underruns


async def one_request(client: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    s, arrivals, t0 = Sample(), [], time.perf_counter()
    try:
        async with client.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return s
            async for raw in r.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter() - t0
                if chunk.get("usage"):
                    s.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    audio = choice["delta"].get("audio") or {}
                    has_text = audio.get("transcript") is not None or choice["delta"].get("content") is not None
                    if has_text and s.ttft_s is None and choice["delta"].get("role") is None:
                        s.ttft_s = now
                    if audio.get("data"):
                        dur = pcm16_seconds(base64.b64decode(audio["data"]), PCM16.sample_rate)
                        arrivals.append((now, dur))
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return s
    s.latency_s = time.perf_counter() - t0
    if arrivals:
        s.ttfp_s = arrivals[0][0]
        s.audio_s = sum(d for _, d in arrivals)
        s.rtf = arrivals[-1][0] / s.audio_s
        s.gaps_s = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])]
        s.max_gap_s = max(s.gaps_s, default=0.0)
        s.underruns = underruns(arrivals)
    s.ok = s.error is None
    return s
