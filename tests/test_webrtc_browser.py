"""Headless Chromium (the Debian package) opens the voice demo, talks through a fake microphone that plays
a spoken WAV, and hears the agent: the page's own WebRTC stack against the server, on loopback."""

from __future__ import annotations

import contextlib
import shutil

import httpx
import numpy as np
import pytest
import soundfile

from app.audio.resample import resample
from tests.conftest import ARTIFACTS
from tests.realtime_helpers import espeak_utterance

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         "--autoplay-policy=no-user-gesture-required"]


def mic_wav(tmp_path, tail_silence_s: float):
    """48 kHz mono PCM16: 1 s silence, the spoken utterance, then `tail_silence_s` of silence; Chromium's
    fake microphone loops it, so the user speaks again after that."""
    samples, _ = espeak_utterance(tmp_path)
    audio = np.concatenate([resample(samples, 24000, 48000), np.zeros(int(48000 * tail_silence_s), np.float32)])
    path = tmp_path / "mic.wav"
    soundfile.write(path, audio, 48000, subtype="PCM_16")
    return path


@contextlib.asynccontextmanager
async def demo_page(server, tmp_path, tail_silence_s: float):
    """The demo page in a fresh headless Chromium whose microphone plays speech; yields (page, console)."""
    if shutil.which(CHROMIUM) is None:
        pytest.skip("chromium is not installed (make sysdeps)")
    from playwright.async_api import async_playwright

    wav = mic_wav(tmp_path, tail_silence_s)
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,  # a fresh --user-data-dir
            args=[*FLAGS, f"--use-file-for-fake-audio-capture={wav}"])
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            console = []
            page.on("console", lambda m: console.append(m.text))
            await page.goto(server.url + "/")
            await page.wait_for_function("document.querySelectorAll('#voice option').length > 0")
            yield page, console
        finally:
            await context.close()
    h = server.wait_idle()
    assert h["active_requests"] == 0 and h["free_slots"] == h["slots"]


async def test_browser_talks_to_the_agent(server, tmp_path):
    async with demo_page(server, tmp_path, tail_silence_s=40) as (page, console):
        voices = httpx.get(f"{server.url}/v1/voices", timeout=5).json()["voices"]
        assert await page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == voices
        await page.select_option("#voice", "chelsie")
        await page.click("#talk")
        # the user's turn (server VAD on the fake microphone), then the agent's transcript and audio
        await page.wait_for_selector("#transcript li.user", timeout=60_000)
        await page.wait_for_function("demo.turns.length && demo.turns[0].transcript.length > 0", timeout=90_000)
        await page.wait_for_function("demo.audio && !demo.audio.paused && demo.audio.currentTime > 0.5 && "
                                     "demo.turns[0].heardAt !== null && demo.maxAgentLevel > 0.01", timeout=60_000)
        await page.wait_for_function("demo.turns[0].audioMs !== null", timeout=60_000)  # played to the end
        agent_text = await page.inner_text("#transcript li.agent .text")
        turn = await page.evaluate("({...demo.turns[0], el: null, row: null})")
        await page.screenshot(path=str(ARTIFACTS / "webrtc-demo.png"), full_page=True)
        metrics = await page.inner_text("#metrics tbody tr")
        await page.click("#talk")  # hang up
    assert agent_text.strip() and agent_text.strip() == turn["transcript"].strip()  # innerText trims
    assert turn["heardAt"] - turn["since"] > 0
    cells = metrics.split("\t")
    assert cells[0] == "1" and cells[1].endswith(" ms") and cells[2] != "…" and cells[5] in ("completed", "incomplete")
    assert not [m for m in console if "error" in m.lower()], console
    print(f"\nbrowser turn: {metrics!r}")


async def test_browser_user_interrupts_by_talking(server, tmp_path):
    """The microphone speaks again ~4 s into the agent's answer: the page stops hearing it and a new turn follows."""
    async with demo_page(server, tmp_path, tail_silence_s=3) as (page, console):
        await page.click("#talk")
        await page.wait_for_function("demo.turns.length && demo.turns[0].heardAt !== null", timeout=90_000)
        await page.wait_for_function("demo.turns[0].status === 'interrupted'", timeout=60_000)
        await page.wait_for_function("demo.agentLevel < 0.002", timeout=5_000)  # the agent went quiet
        assert await page.eval_on_selector("#transcript li.agent", "li => li.classList.contains('cancelled')")
        await page.wait_for_function("demo.turns.length >= 2", timeout=60_000)  # the interrupting turn is answered
        await page.screenshot(path=str(ARTIFACTS / "webrtc-demo-barge-in.png"), full_page=True)
        first = await page.evaluate("({...demo.turns[0], el: null, row: null})")
        row = (await page.inner_text("#metrics tbody tr")).split("\t")
    assert 0 < first["audioMs"] < 8000  # truncated where the user cut in
    assert row[1].endswith(" ms") and row[2] == "—" and row[5] == "interrupted"
