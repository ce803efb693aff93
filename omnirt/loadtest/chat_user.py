"""Locust user: streaming chat completions with spoken input and audio output, as an app would call
`POST /v1/chat/completions` with `stream: true`. Reports the request itself, plus time to first
audio, end-to-end latency, gaps between audio packets and underruns; a 429 counts as a failure."""

from __future__ import annotations

import base64
import io
import json
import os
import time

import soundfile
from locust import HttpUser, between, task

from omnirt.loadtest.audio_metrics import AudioTrace
from omnirt.loadtest.speech import speech

NAME = "POST /v1/chat/completions (stream, audio)"
CHECK_FRAMES = os.environ.get("OMNIRT_LOADTEST_MODEL", "tiny") == "tiny"  # PCM length per frame is the tiny codec's


def spoken_wav_b64() -> str:
    buf = io.BytesIO()
    soundfile.write(buf, speech(16000), 16000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


class ChatAudioUser(HttpUser):
    wait_time = between(0.5, 1.5)
    max_tokens = int(os.environ.get("OMNIRT_LOADTEST_MAX_TOKENS", "24"))

    def on_start(self) -> None:
        key = os.environ.get("OMNIRT_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.audio_b64 = spoken_wav_b64()

    def body(self) -> dict:
        return {"model": os.environ.get("OMNIRT_LOADTEST_MODEL", "tiny"), "stream": True,
                "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": self.audio_b64, "format": "wav"}},
                    {"type": "text", "text": "Answer the question you heard."}]}]}

    @task
    def stream_audio(self) -> None:
        trace = AudioTrace(time.perf_counter())
        with self.client.post("/v1/chat/completions", json=self.body(), headers=self.headers, stream=True,
                              catch_response=True, name=NAME, timeout=300) as r:
            if r.status_code != 200:
                r.failure(f"{r.status_code} {r.text[:200]}")
                return
            error = _read_stream(r, trace)
            if error:
                r.failure(error)
                return
            r.success()
        trace.report(self.environment, "chat", ended=time.perf_counter())


def _read_stream(r, trace: AudioTrace) -> str | None:
    """Feed every audio delta to the trace; returns why the stream failed, or None."""
    done, frames = False, None
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return f"stream error: {chunk['error'].get('code')}: {chunk['error'].get('message')}"
        if chunk.get("usage"):
            frames = chunk["usage"]["completion_tokens_details"]["audio_tokens"]
        for choice in chunk["choices"]:
            data = (choice["delta"].get("audio") or {}).get("data")
            if data:
                trace.on_audio(base64.b64decode(data))
    if not done:
        return "stream ended without [DONE]"
    if CHECK_FRAMES and frames and trace.num_bytes // 2 != frames * 1920 - 555:  # tiny codec: a lost packet shows
        return f"audio incomplete: {trace.num_bytes // 2} samples for {frames} frames"
    return None
