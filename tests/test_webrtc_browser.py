"""Headless Chromium (the Debian package) opens the voice demo, talks through a fake microphone that plays
a spoken WAV, hears the agent and sees the transcript of what it said, and runs the page's demo tools: the
page's own WebRTC stack against the server, on loopback. The tests other than the tools' load the page with
`?tools=off`, so that a call the tiny model might make by itself never changes their turns."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import shutil
import threading

import httpx
import numpy as np
import pytest
import soundfile

from omnirt.app.audio.resample import resample
from tests.conftest import ARTIFACTS, HANG_GUARD_S, ServerProcess, until
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
async def demo_page(server, tmp_path, tail_silence_s: float, responses: list | None = None,
                    query: str = "?tools=off"):
    """The demo page (`/` + `query`) in a fresh headless Chromium whose microphone plays speech; yields
    (page, console). `responses`: every response the page receives is appended (from its first request on)."""
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
            if responses is not None:
                page.on("response", lambda r: responses.append(r))
            await page.goto(server.url + "/" + query)
            await page.wait_for_function("document.querySelectorAll('#voice option').length > 0")
            yield page, console
        finally:
            await context.close()
    h = server.wait_idle()
    assert h["active_requests"] == 0 and h["free_slots"] == h["slots"]


async def test_browser_talks_to_the_agent(server, tmp_path):
    responses = []
    async with demo_page(server, tmp_path, tail_silence_s=40, responses=responses) as (page, console):
        voices = httpx.get(f"{server.url}/v1/voices", timeout=HANG_GUARD_S).json()["voices"]
        assert await page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)") == voices
        assert await page.inner_text("#model") == "tiny"  # the served model, before any call
        assert (await page.inner_text("#status")).startswith("Press Talk")
        await page.select_option("#voice", "chelsie")
        await page.click("#talk")
        await page.wait_for_function("document.querySelector('#status').textContent === 'Connected: talk.'",
                                     timeout=60_000)
        # the user's turn (server VAD on the fake microphone), then the agent's transcript and audio
        await page.wait_for_selector("#transcript li.user", timeout=60_000)
        await page.wait_for_function("demo.turns.length && demo.turns[0].transcript.length > 0", timeout=90_000)
        await page.wait_for_function("demo.audio && !demo.audio.paused && demo.audio.currentTime > 0.5 && "
                                     "demo.turns[0].heardAt !== null && demo.maxAgentLevel > 0.01", timeout=60_000)
        await page.wait_for_function("demo.turns[0].audioMs !== null", timeout=60_000)  # played to the end
        # the page asked for transcripts of the user: the first user turn shows the server's
        await page.wait_for_function("[...demo.userTurns.values()][0]?.transcript != null", timeout=60_000)
        user_transcript = await page.evaluate("[...demo.userTurns.values()][0].transcript")
        user_text = await page.inner_text("#transcript li.user .text")
        agent_text = await page.inner_text("#transcript li.agent .text")
        turn = await page.evaluate("({...demo.turns[0], el: null, row: null})")
        await page.screenshot(path=str(ARTIFACTS / "webrtc-demo.png"), full_page=True)
        metrics = await page.inner_text("#metrics tbody tr")
        await page.click("#talk")  # hang up
        status = await page.inner_text("#status")
    assert status.startswith("You hung up. Press Talk"), status
    assert [r.status for r in responses if r.url.endswith("/favicon.svg")] == [200]
    assert not [(r.url, r.status) for r in responses if r.status >= 400]  # no favicon 404, nothing else
    assert agent_text.strip() and agent_text.strip() == turn["transcript"].strip()  # innerText trims
    assert user_text.strip() == (user_transcript.strip() or "(nothing heard)")
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
        await page.wait_for_function("demo.agentLevel < 0.002", timeout=60_000)  # the agent went quiet
        assert await page.eval_on_selector("#transcript li.agent", "li => li.classList.contains('cancelled')")
        await page.wait_for_function("demo.turns.length >= 2", timeout=60_000)  # the interrupting turn is answered
        await page.wait_for_function("demo.turns[0].heard !== null", timeout=60_000)  # the item as the server cut it
        await page.screenshot(path=str(ARTIFACTS / "webrtc-demo-barge-in.png"), full_page=True)
        first = await page.evaluate("({...demo.turns[0], el: null, row: null})")
        shown = await page.inner_text("#transcript li.agent .text")
        row = (await page.inner_text("#metrics tbody tr")).split("\t")
    assert 0 < first["audioMs"] < 8000  # truncated where the user cut in
    # the interrupted answer shows only what was heard: the server's truncated transcript, a prefix of all it sent
    assert shown.strip() == first["heard"].strip() and first["transcript"].startswith(first["heard"])
    assert row[1].endswith(" ms") and row[2] == "—" and row[5] == "interrupted"


async def test_browser_runs_a_forced_tool_call(server, tmp_path):
    """`?tool_choice=roll_dice` makes the user's turn a call: the page rolls the dice, shows the call and its
    result, sends the result (the server takes it) and asks for the reply, which comes."""
    async with demo_page(server, tmp_path, tail_silence_s=120, query="?tool_choice=roll_dice") as (page, console):
        assert await page.is_checked("#tools") and await page.input_value("#tool-choice") == "roll_dice"
        await page.click("#talk")
        await page.wait_for_function("demo.calls.size && [...demo.calls.values()].every((c) => c.accepted)",
                                     timeout=120_000)
        await page.wait_for_function("demo.turns.some((t) => t.afterTools && t.doneAt !== null)", timeout=180_000)
        await page.wait_for_function("[...demo.userTurns.values()][0]?.transcript != null", timeout=60_000)
        turns = await page.evaluate("demo.turns.map((t) => ({...t, el: null, row: null, "
                                    "calls: t.calls.map((c) => ({...c, el: null}))}))")
        shown = await page.eval_on_selector_all("#transcript li.tool", "ls => ls.map((l) => [...l.querySelectorAll("
                                                "'.call, .result')].map((c) => c.textContent))")
        agents = await page.eval_on_selector_all("#transcript li.agent .text", "ls => ls.map((l) => l.textContent)")
        user_transcript = await page.evaluate("[...demo.userTurns.values()][0].transcript")
        user_text = await page.inner_text("#transcript li.user .text")
        rows = await page.eval_on_selector_all("#metrics tbody tr", "rs => rs.map((r) => r.innerText.split('\\t'))")
        await page.screenshot(path=str(ARTIFACTS / "webrtc-demo-tools.png"), full_page=True)
        await page.click("#talk")
    first, reply = turns[0], next(t for t in turns if t["afterTools"])
    assert first["status"] == "completed" and not first["spoke"] and first["calls"] and not first["transcript"]
    assert len(shown) == len(first["calls"])  # the call-only reply has no agent line: its tool lines stand for it
    for call, (what, result) in zip(first["calls"], shown):
        args, out = json.loads(call["arguments"]), json.loads(result)
        assert call["name"] == "roll_dice" and what == f"roll_dice({call['arguments']})" and result == call["output"]
        assert 2 <= args["sides"] <= 100 and 1 <= args["count"] <= 10  # the grammar kept to the schema
        assert len(out["rolls"]) == args["count"] and all(1 <= r <= args["sides"] for r in out["rolls"])
        assert out["total"] == sum(out["rolls"]) and call["sent"] and call["accepted"]
    assert reply["status"] in ("completed", "incomplete")
    assert rows[0][1:5] == ["—"] * 4 and rows[0][5] == "completed (roll_dice)"
    assert agents == [t["transcript"] for t in turns if t["spoke"]]
    assert user_text.strip() == (user_transcript.strip() or "(nothing heard)")
    assert not [m for m in console if "error" in m.lower()], console


DEMO_KEYS = {"demo": "sk-demo-key-0001", "backend": "sk-backend-key-0002"}
EVIL_PAGE = """<!doctype html><script>
window.result = {};
const ws = new WebSocket("ws://127.0.0.1:{port}/v1/realtime");
ws.onopen = () => { result.ws = "open"; };
ws.onclose = (e) => { result.ws = result.ws || `closed ${e.code}`; };
fetch("http://127.0.0.1:{port}/demo/client_secret", { method: "POST" })
  .then((r) => { result.secret = `read ${r.status}`; }, () => { result.secret = "blocked"; });
</script>"""


@pytest.fixture(scope="module")
def keyed_demo_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(json.dumps({"keys": [{"id": "demo", "key": DEMO_KEYS["demo"], "max_sessions": 2},
                                         {"id": "backend", "key": DEMO_KEYS["backend"]}]}))
    srv = ServerProcess(["--api-keys-file", str(path), "--demo-key-id", "demo", "--log-level", "info"])
    yield srv
    srv.stop()


@contextlib.contextmanager
def other_origin(tmp_path, port: int):
    """A page on another loopback origin (a second port), trying what the demo page does."""
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "index.html").write_text(EVIL_PAGE.replace("{port}", str(port)))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "evil"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        thread.join()


async def test_demo_with_keys_on_never_holds_a_key(keyed_demo_server, tmp_path):
    """With --demo-key-id the page talks to the agent on a client secret per call; no key reaches it; a page
    of another origin gets neither a secret nor a session (the server refuses both and logs it)."""
    srv, responses = keyed_demo_server, []
    async with demo_page(srv, tmp_path, tail_silence_s=40, responses=responses) as (page, console):
        assert await page.evaluate("demo.auth") == "client_secret"
        await page.click("#talk")
        await page.wait_for_selector("#transcript li.user", timeout=60_000)
        await page.wait_for_function("demo.turns.length && demo.turns[0].heardAt !== null", timeout=90_000)
        assert srv.metric("omnirt_key_active", key="demo", kind="sessions") == 1
        await page.click("#talk")  # hang up: a client secret cannot call hangup; closing the connection ends it
        demo_console = list(console)
        with other_origin(tmp_path, srv.port) as evil_url:
            await page.goto(evil_url)
            await page.wait_for_function("result.ws && result.secret", timeout=30_000)
            evil = await page.evaluate("result")
        calls = [r for r in responses if r.url.endswith("/v1/realtime/calls")]
        assert len(calls) == 1 and calls[0].status == 201
        assert (await calls[0].request.all_headers())["authorization"].startswith("Bearer ek_")
        for r in responses:  # every byte the page was sent or sent itself: no key
            seen = json.dumps(await r.request.all_headers()) + (r.request.post_data or "") + await _body(r)
            assert not [k for k in DEMO_KEYS.values() if k in seen], r.url
    # the call ends when its peer goes (however long that takes)
    await until(lambda: srv.metric("omnirt_key_active", key="demo", kind="sessions") == 0, "the demo's call ended")
    assert evil == {"ws": "closed 1006", "secret": "blocked"}, evil
    log = srv.log.read_text()
    evil_origin = evil_url.rstrip("/")
    assert f"refused WebSocket /v1/realtime from origin '{evil_origin}'" in log
    assert f"refused POST /demo/client_secret from origin '{evil_origin}'" in log
    assert not [m for m in demo_console if "error" in m.lower()], demo_console


async def _body(response) -> str:
    try:
        return (await response.body()).decode(errors="replace")
    except Exception:  # a redirect or a body the browser already dropped
        return ""
