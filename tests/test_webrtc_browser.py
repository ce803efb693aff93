"""Headless Chromium (the Debian package) opens the voice demo, talks through a fake microphone that plays
a spoken WAV, and hears the agent: the page's own WebRTC stack against the server, on loopback."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import soundfile

from app.audio import resample
from tests.conftest import ARTIFACTS
from tests.realtime_helpers import espeak_utterance

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         "--autoplay-policy=no-user-gesture-required"]
TAIL_SILENCE_S = 40  # the fake microphone loops its file: the user speaks again only after the answer


@pytest.fixture
def mic_wav(tmp_path):
    """48 kHz mono PCM16: 1 s silence, the spoken utterance, then a long silence."""
    samples, _ = espeak_utterance(tmp_path)
    audio = np.concatenate([resample(samples, 24000, 48000), np.zeros(48000 * TAIL_SILENCE_S, np.float32)])
    path = tmp_path / "mic.wav"
    soundfile.write(path, audio, 48000, subtype="PCM_16")
    return path


async def test_browser_talks_to_the_agent(server, mic_wav, tmp_path):
    if shutil.which(CHROMIUM) is None:
        pytest.skip("chromium is not installed (make sysdeps)")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,  # a fresh --user-data-dir
            args=[*FLAGS, f"--use-file-for-fake-audio-capture={mic_wav}"])
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            messages = []
            page.on("console", lambda m: messages.append(m.text))
            await page.goto(server.url + "/")
            await page.wait_for_function("document.querySelectorAll('#voice option').length > 0")
            voices = httpx.get(f"{server.url}/v1/voices", timeout=5).json()["voices"]
            assert await page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == voices
            await page.select_option("#voice", "chelsie")
            await page.click("#talk")
            # the user's turn (server VAD on the fake microphone), then the agent's transcript and audio
            await page.wait_for_selector("#transcript li.user", timeout=60_000)
            await page.wait_for_function("demo.turns.length && demo.turns[0].transcript.length > 0", timeout=90_000)
            await page.wait_for_function("demo.audio && !demo.audio.paused && demo.audio.currentTime > 0.5 && "
                                         "demo.turns[0].heardAt !== null && demo.maxAgentLevel > 0.01",
                                         timeout=60_000)
            await page.wait_for_function("demo.turns[0].audioMs !== null", timeout=60_000)  # played to the end
            agent_text = await page.inner_text("#transcript li.agent .text")
            turn = await page.evaluate("({...demo.turns[0], el: null, row: null})")
            await page.screenshot(path=str(ARTIFACTS / "webrtc-demo.png"), full_page=True)
            metrics = await page.inner_text("#metrics tbody tr")
            await page.click("#talk")  # hang up
        finally:
            await context.close()
    assert agent_text.strip() and agent_text.strip() == turn["transcript"].strip()  # innerText trims
    assert turn["heardAt"] - turn["since"] > 0
    cells = metrics.split("\t")
    assert cells[0] == "1" and cells[1].endswith(" ms") and cells[2] != "…" and cells[5] in ("completed", "incomplete")
    assert not [m for m in messages if "error" in m.lower()], messages
    h = server.wait_idle()
    assert h["active_requests"] == 0 and h["free_slots"] == h["slots"]
    print(f"\nbrowser turn: {metrics!r}")
