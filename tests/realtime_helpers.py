"""Shared pieces of the Realtime tests: a real espeak-ng utterance, and event collection with timeouts."""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile

from app.audio import float_to_pcm16, resample

UTTERANCE = "Hello there. Could you please tell me a short story about a friendly dragon?"
LEAD_S, TAIL_S = 1.0, 1.5


def espeak_utterance(tmp_dir: Path, text: str = UTTERANCE) -> tuple[np.ndarray, float]:
    """(24 kHz float32 mono: 1 s silence, the spoken text, 1.5 s silence; the speech's duration in s)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (make sysdeps)")
    wav = tmp_dir / "utterance.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True, timeout=60)
    speech, rate = soundfile.read(wav, dtype="float32")
    speech = resample(speech, rate, 24000)
    silence = np.zeros(int(LEAD_S * 24000), np.float32), np.zeros(int(TAIL_S * 24000), np.float32)
    return np.concatenate([silence[0], speech, silence[1]]), len(speech) / 24000


def b64_chunks(samples: np.ndarray, chunk_ms: int = 100, rate: int = 24000) -> list[str]:
    pcm = float_to_pcm16(samples)
    step = rate * chunk_ms // 1000 * 2
    return [base64.b64encode(pcm[i:i + step]).decode() for i in range(0, len(pcm), step)]


async def collect_until(conn, predicate, timeout: float = 120.0) -> list:
    """Events from an SDK connection up to and including the first for which predicate(ev) holds."""
    events = []

    async def run():
        async for ev in conn:
            events.append(ev)
            if predicate(ev):
                return

    await asyncio.wait_for(run(), timeout)
    return events


def response_done(events: list, response_id: str | None = None):
    for ev in events:
        if ev.type == "response.done" and (response_id is None or ev.response.id == response_id):
            return ev
    raise AssertionError("no response.done")
