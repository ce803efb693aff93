"""A minimal streaming chat client for the reliability tests: posts one request, reads the SSE stream,
and returns what arrived (status, first-audio time, PCM, usage, finish reason, in-stream error)."""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

import httpx

MSG = [{"role": "user", "content": "Hello! Tell me something nice."}]


def audio_body(max_tokens: int = 16, frames: int | None = None, text: str | None = None) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}] if text else MSG,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": max_tokens}
    if frames:
        body["talker_sampling"] = {"max_tokens": frames, "min_tokens": frames}
    return body


@dataclass
class StreamResult:
    status: int = 0
    headers: dict = field(default_factory=dict)
    ttfp_s: float | None = None
    pcm: bytearray = field(default_factory=bytearray)
    num_packets: int = 0
    audio_frames: int | None = None
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    body: str = ""

    @property
    def is_complete(self) -> bool:
        """[DONE] arrived and the PCM holds every codec frame the usage reports (no packet lost)."""
        return (self.done and self.audio_frames is not None and self.audio_frames > 0
                and len(self.pcm) // 2 == pcm_samples_for_frames(self.audio_frames))


def pcm_samples_for_frames(frames: int) -> int:
    """24 kHz samples the tiny model's Code2Wav makes of `frames` codec frames (1920 per frame, less the
    vocoder's edge trim): what a complete stream of them adds up to."""
    return frames * 1920 - 555


def _json_error(body: str) -> dict | None:
    try:
        return json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None


def stream_chat(url: str, body: dict, headers: dict | None = None, timeout: float = 120) -> StreamResult:
    res, start = StreamResult(), time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
        res.status, res.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            res.body = r.read().decode()
            res.error = _json_error(res.body)
            return res
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                res.done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.error = chunk["error"]
                continue
            if chunk.get("usage"):
                res.audio_frames = chunk["usage"]["completion_tokens_details"]["audio_tokens"]
            for choice in chunk["choices"]:
                data = (choice["delta"].get("audio") or {}).get("data")
                if data:
                    res.ttfp_s = res.ttfp_s or time.monotonic() - start
                    res.pcm += base64.b64decode(data)
                    res.num_packets += 1
                res.finish_reason = choice["finish_reason"] or res.finish_reason
    return res
