"""Chat TTFP for the spoken utterance `omnirt bench realtime` sends, as `input_audio` (and for a short text
prompt): the engine's own first-audio time for that turn, without the session layer. Prints one line per
request; the realtime bench's response latency for the same utterance compares against it."""

from __future__ import annotations

import base64
import sys
import time

import httpx

from omnirt.app.audio.pcm import encode_wav, float_to_pcm16
from omnirt.loadtest.realtime_mic import RATE, utterance


def ttfp_ms(url: str, model: str, content) -> float | None:
    body = {"model": model, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "stream": True, "messages": [{"role": "user", "content": content}], "max_tokens": 40}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"audio"' in line and '"data"' in line:
                return (time.perf_counter() - start) * 1000
    return None


def main(url: str, model: str, reps: int = 5) -> None:
    wav = encode_wav(float_to_pcm16(utterance(None)[0]), RATE)
    spoken = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}]
    for name, content in (("spoken", spoken), ("text", "Hello! Tell me something nice.")):
        for _ in range(reps):
            print(f"chat {name} ttfp_ms {ttfp_ms(url, model, content):.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
