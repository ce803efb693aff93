"""WebRTC calls against a real server on loopback: an aiortc peer in the test process talks to it."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys
import time

import httpx
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from omnirt.app.audio.vad import VAD_RATE
from omnirt.app.server import create_app
from omnirt.app.state import ServerSettings, app_state
from omnirt.app.transports.ice import IceSettings
from omnirt.app.transports.webrtc import CLOSE_STEP_TIMEOUT_S, Call, call_registry
from omnirt.loadtest.webrtc_client import RealtimeCall, connect
from tests.conftest import ROOT, ServerProcess, until
from tests.realtime_helpers import LEAD_S

LONG_ANSWER = {"max_output_tokens": 16, "talker_sampling": {"min_tokens": 300, "max_tokens": 300}}  # 24 s of audio
SILENT_PEAK = 64  # Opus-decoded digital silence stays ~0; speech-codec output peaks in the thousands


def of_type(kind: str, **fields):
    return lambda ev: ev["type"] == kind and all(ev.get(k) == v for k, v in fields.items())


FRAME_S = 0.020  # one Opus frame


def frames_between(call: RealtimeCall, t0: float, t1: float) -> list:
    return [f for f in call.frames if t0 <= f.arrival_s <= t1]


def loud_ms(frames: list) -> float:
    return sum(f.num_samples for f in frames if f.peak > SILENT_PEAK) * 1000 / 48000


def never_ahead_of_real_time(frames: list, t_before: float) -> bool:
    """The server's track paces itself: its frame k goes out no sooner than its start + k x 20 ms, and it
    started after `t_before`. A bound a loaded machine cannot break (it only delays frames)."""
    return all(i <= (f.arrival_s - t_before) / FRAME_S + 1 for i, f in enumerate(frames))


async def arrival(call: RealtimeCall, predicate, timeout: float = 120.0) -> tuple[dict, float]:
    """The event and when the test saw it."""
    ev = await call.wait_for(predicate, timeout)
    return ev, time.monotonic()


async def is_dropped(srv: ServerProcess, location: str) -> bool:
    """Whether the server dropped the call by itself: once it counts no WebRTC session (however long that
    takes), there is no call to hang up (404; a 200 would mean it was still there, and this probe hung it up)."""
    await until(lambda: srv.metric("omnirt_sessions_active", transport="webrtc") == 0, "the call dropped")
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.post(f"{srv.url}{location}/hangup")).status_code == 404


async def long_answer(call: RealtimeCall) -> tuple[dict, float]:
    """Ask by text for a long spoken answer; returns `output_audio_buffer.started` and its arrival."""
    call.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Tell me a long story."}]}})
    call.send({"type": "response.create", "response": LONG_ANSWER})
    return await arrival(call, of_type("output_audio_buffer.started"), 60)


async def test_voice_turn_paced_audio_and_transcript(server, utterance):
    """A spoken turn answered on the media track: 20 ms Opus frames, never ahead of real time, carrying sound;
    the gaps between them and the playout's wall time against the audio's are printed (figures: a loaded
    machine moves them; `omnirt bench realtime --transport webrtc` measures underruns)."""
    samples, speech_s = utterance
    t_before = time.monotonic()
    call = await connect(server.url)
    try:
        created = await call.wait_for(of_type("session.created"), 30)
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        await call.say(samples)
        stopped_speech, t_user_end = await arrival(call, of_type("input_audio_buffer.speech_stopped"))
        started, t_first = await arrival(call, of_type("output_audio_buffer.started"))
        done = await call.wait_for(of_type("response.done"))
        stopped, t_last = await arrival(call, of_type("output_audio_buffer.stopped"), 60)
        audio_ms = stopped["omnirt_playback"]["audio_ms"]
        # speech-codec output, not silence: once its frames are in, most of the reply's audio carries sound
        await until(lambda: loud_ms(call.frames) > 0.5 * audio_ms, "the reply's audio received")
    finally:
        await call.close()
    types = call.types()
    # the VAD heard the real speech through Opus + PyAV resampling
    assert abs(stopped_speech["audio_end_ms"] - (LEAD_S + speech_s) * 1000) < 500
    response = done["response"]
    assert started["response_id"] == stopped["response_id"] == response["id"]
    assert response["status"] in ("completed", "incomplete")
    transcript = "".join(e["delta"] for e in call.events if e["type"] == "response.output_audio_transcript.delta")
    assert transcript and transcript == response["output"][0]["content"][0]["transcript"]
    assert "response.output_audio.delta" not in types  # the audio went out on the media track
    assert types.index("response.done") < types.index("output_audio_buffer.stopped")
    assert {(f.sample_rate, f.num_samples) for f in call.frames} == {(48000, 960)}  # 20 ms Opus frames
    assert never_ahead_of_real_time(call.frames, t_before)
    assert audio_ms > 1000
    playing = frames_between(call, t_first, t_last)
    gaps_ms = np.diff([f.arrival_s for f in playing]) * 1000
    print(f"\nwebrtc turn: {len(playing)} frames, gap p50 {np.median(gaps_ms):.2f} ms p95 "
          f"{np.percentile(gaps_ms, 95):.2f} ms, played in {1000 * (t_last - t_first):.0f} ms for {audio_ms} ms "
          f"of audio, first audio {1000 * (t_first - t_user_end):.0f} ms after speech_stopped, underruns "
          f"{stopped['omnirt_playback']['num_underruns']}")
    assert server.wait_idle()["active_requests"] == 0


async def test_barge_in_stops_the_audio(server, utterance):
    """The user talks over a 24 s answer: it is cancelled, truncated at what was played (no more than the
    wall time since it was asked for: the track is paced), and the stream goes on silent. The session asks
    for no response to the user's turn, so that nothing but the cut answer could sound."""
    samples, _ = utterance
    call = await connect(server.url)
    try:
        await call.wait_for(of_type("session.created"), 30)
        call.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False}}}}})
        await call.wait_for(of_type("session.updated"), 30)
        t_asked = time.monotonic()
        started, t_started = await long_answer(call)
        await asyncio.sleep(1.0)
        await call.say(samples)  # 1 s of silence, then the user talks over the agent
        cleared, t_cleared = await arrival(call, of_type("output_audio_buffer.cleared"))
        done = await call.wait_for(of_type("response.done"))
        truncated = await call.wait_for(of_type("conversation.item.truncated"))
        num_heard = sum(f.peak > SILENT_PEAK for f in call.frames)
        await call.wait_for(of_type("input_audio_buffer.speech_stopped"))  # the user has finished talking
        since = len(call.frames)  # the user's whole utterance after the clear: what was in flight is in
        await until(lambda: len(call.frames) >= since + 50, "a second of the stream after the user's turn")
    finally:
        await call.close()
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    assert cleared["response_id"] == started["response_id"] == done["response"]["id"]
    assert truncated["item_id"] == done["response"]["output"][0]["id"]
    # the truncation point is what the track sent, and a paced track cannot have sent more than the wall time
    assert 0 < truncated["audio_end_ms"] <= (t_cleared - t_asked) * 1000 + 2 * FRAME_S * 1000, truncated
    assert num_heard > 0  # the user heard the answer before cutting in
    assert call.types().count("response.created") == 1  # no answer to the user's turn
    assert max(f.peak for f in call.frames[since:]) <= SILENT_PEAK, [f.peak for f in call.frames[since:]]
    print(f"\nbarge-in: truncated at {truncated['audio_end_ms']} ms, {1000 * (t_cleared - t_started):.0f} ms "
          f"after the client saw output_audio_buffer.started")


async def test_client_hangs_up_mid_answer_frees_every_stage(server):
    call = await connect(server.url)
    await call.wait_for(of_type("session.created"), 30)
    await long_answer(call)
    await call.close()  # like a closed tab: the peer connection goes away mid-answer
    h = server.wait_idle()
    assert h["active_requests"] == 0 and h["free_slots"] == h["slots"]
    assert await is_dropped(server, call.location)


async def test_client_that_vanishes_is_dropped(server):
    """A client killed mid-answer (no DTLS close, no hangup; as a lost network): its media stops, and the
    server ends the call after `MEDIA_TIMEOUT_S` and frees every stage."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.webrtc_vanish", server.url, cwd=ROOT,
                                                stdout=asyncio.subprocess.PIPE)
    location = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode().strip()
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL and location.startswith("/v1/realtime/calls/")
    assert await is_dropped(server, location)  # by the media timeout: no hangup came
    h = server.wait_idle()
    assert h["active_requests"] == 0 and h["free_slots"] == h["slots"]


async def test_hangup_endpoint_and_beta_path(server):
    call = await connect(server.url, "/v1/realtime?model=tiny")
    try:
        created = await call.wait_for(of_type("session.created"), 30)
        assert created["session"]["object"] == "realtime.session" and "modalities" in created["session"]  # beta
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{server.url}{call.location}/hangup")
            assert r.status_code == 200
            r = await http.post(f"{server.url}{call.location}/hangup")
            assert r.status_code == 404 and r.json()["error"]["code"] == "call_not_found"
        await until(lambda: call.pc.connectionState in ("closed", "failed"), "the call to end")
        assert call.channel.readyState == "closed"
    finally:
        await call.close()


async def test_bad_offers_get_http_errors(server):
    async with httpx.AsyncClient(timeout=30) as http:
        url = f"{server.url}/v1/realtime/calls"
        r = await http.post(url, json={"sdp": "v=0"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_type"
        sdp = {"Content-Type": "application/sdp"}
        r = await http.post(url, content=b"hello", headers=sdp)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sdp"
        r = await http.post(url, content=b"v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n", headers=sdp)
        assert r.status_code == 400 and "no audio" in r.json()["error"]["message"]
        r = await http.post(url, content=b"v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nGARBAGE", headers=sdp)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post(f"{server.url}/v1/realtime?model=gpt-4o", content=b"v=0\r\n", headers=sdp)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (await http.get(f"{server.url}/health")).status_code == 200
    call = await connect(server.url, extra_video=True)  # the server goes on; it declines the video
    try:
        await call.wait_for(of_type("session.created"), 30)
        video = next(t for t in call.pc.getTransceivers() if t.kind == "video")
        assert video.currentDirection == "inactive"
    finally:
        await call.close()


@pytest.fixture(scope="module")
def one_session_server():
    # a short drain: SIGTERM mid-answer must not wait for the answer to end (the default is 30 s)
    srv = ServerProcess(["--realtime-max-sessions", "1", "--webrtc-connect-timeout-s", "5", "--log-level", "info",
                         "--shutdown-timeout", "3"])
    yield srv
    srv.stop()


async def test_call_that_never_connects_is_closed(one_session_server):
    """ICE never completes (the client vanished after its offer): the call ends at the connect timeout."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.createDataChannel("oai-events")
    pc.addTransceiver("audio")
    await pc.setLocalDescription(await pc.createOffer())
    await pc.close()
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{one_session_server.url}/v1/realtime/calls", content=pc.localDescription.sdp,
                            headers={"Content-Type": "application/sdp"})
        assert r.status_code == 201
        call_id = r.headers["location"].rsplit("/", 1)[-1]
        await until(lambda: f"webrtc {call_id}: closing (not connected after 5 s)" in
                    one_session_server.log.read_text(), "the connect timeout")
        assert (await http.post(f"{one_session_server.url}{r.headers['location']}/hangup")).status_code == 404
    call = await connect(one_session_server.url)  # its session slot (the only one) is free again
    await call.wait_for(of_type("session.created"), 30)
    await call.close()
    assert await is_dropped(one_session_server, call.location)


async def test_a_closing_step_that_never_ends_does_not_hold_up_the_close(caplog):
    """aiortc's close can wait on a peer forever (it hung a shutdown here): each step of closing a call
    is given up after CLOSE_STEP_TIMEOUT_S, even a step that swallows its cancellation."""
    async def stubborn():  # swallows its first cancellation, like a close still waiting on its peer
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(3600)

    call = Call.__new__(Call)
    call.id, call.log = "rtc_test", logging.getLogger("omnirt.app.transports.webrtc")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "omnirt.app.transports.webrtc"):
        await call._bounded("peer connection close", stubborn())
    assert time.monotonic() - started >= CLOSE_STEP_TIMEOUT_S  # given up on (it would sleep an hour), not sooner
    assert "peer connection close did not finish" in caplog.text


@pytest.mark.timeout(120)  # a close that hangs fails here, not at the suite's 600 s
async def test_no_task_or_track_outlives_a_call(engine):
    """In process: after a page close mid-answer and after shutdown, nothing of the call is left running."""
    app = create_app(engine, ServerSettings(ice=IceSettings(("127.0.0.1",))))
    baseline = asyncio.all_tasks()
    transport = httpx.ASGITransport(app=app)
    ended = []
    for how in ("page closed", "server shutdown"):
        call = await connect("http://localhost", transport=transport)
        await call.wait_for(of_type("session.created"), 30)
        server_call = next(iter(call_registry(app).calls.values()))
        await long_answer(call)
        if how == "page closed":
            await call.close()
        else:
            await call_registry(app).close_all()
            await call.close()
        await asyncio.wait_for(server_call.closing, 60)
        ended.append(server_call)
    await until(lambda: all(t.done() for c in ended for t in [*c.tasks, c.writer, c.session.response.task]),
                "every task of the ended calls done")
    for c in ended:
        assert c.track.readyState == "ended" and c.pc.connectionState == "closed"
        assert all(t.done() for t in [*c.tasks, c.writer]) and c.session.response.task.done()
    assert not call_registry(app).calls and not app_state(app).sessions.sessions
    leftover = [t for t in asyncio.all_tasks() - baseline if not t.done()]
    assert not leftover, leftover
    assert engine.num_active_requests == 0


async def speak(call: RealtimeCall, samples: np.ndarray, played: asyncio.Event) -> None:
    """Say `samples` on the microphone and return once they have all been sent."""
    played.clear()
    await call.say(samples)
    call.mic.response_done("mic")
    await asyncio.wait_for(played.wait(), 60)


@pytest.mark.timeout(180)
async def test_a_stalled_session_drops_old_microphone_audio_and_still_takes_turns(engine, utterance, caplog):
    """In process: the session stops taking microphone audio while the caller speaks a turn and 1.5 s of silence
    follow; it then gets only the newest --webrtc-max-input-lag-s of it (silence: no turn from stale speech), the
    rest is counted in /metrics and logged, and the next spoken turn is heard as one turn."""
    samples, _ = utterance
    app = create_app(engine, ServerSettings(ice=IceSettings(("127.0.0.1",)), webrtc_max_input_lag_s=0.5))
    played = asyncio.Event()
    call = await connect("http://localhost", transport=httpx.ASGITransport(app=app),
                         on_mic_event=lambda ev: ev["type"] == "output_audio_buffer.stopped" and played.set())
    try:
        await call.wait_for(of_type("session.created"), 30)
        call.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "create_response": False}}}}})
        await call.wait_for(of_type("session.updated"), 30)
        server_call = next(iter(call_registry(app).calls.values()))
        gate, taken = asyncio.Event(), []
        append = server_call.session.append_audio

        async def stalled(chunk: np.ndarray, rate: int) -> None:
            taken.append(chunk.size)
            await gate.wait()
            await append(chunk, rate)

        server_call.session.append_audio = stalled
        await speak(call, samples, played)
        mic = server_call.mic
        stall_samples = len(samples) * VAD_RATE // 24000 + int(1.5 * VAD_RATE)
        # 1.5 s more of silence, however long it takes to come: the backlog's newest 0.5 s hold no speech
        await until(lambda: mic.num_dropped_samples >= stall_samples - mic.max_samples - VAD_RATE // 10,
                    "the stale audio dropped")
        assert mic.num_samples <= mic.max_samples == VAD_RATE // 2
        num_stalled = len(taken)
        gate.set()
        await until(lambda: len(taken) > num_stalled + 5, "the backlog taken, and live audio flowing again")
        assert max(taken[num_stalled:]) <= mic.max_samples  # never more than the bound at once
        metrics = (await httpx.AsyncClient(transport=httpx.ASGITransport(app=app)).get("http://localhost/metrics")).text
        dropped_s = float(re.search(r"^omnirt_webrtc_input_dropped_seconds_total (\S+)$", metrics, re.M).group(1))
        assert dropped_s == pytest.approx(mic.num_dropped_samples / VAD_RATE)
        assert "fell more than 500 ms behind the microphone" in caplog.text
        assert "input_audio_buffer.speech_started" not in call.types()  # the stale turn was dropped, not answered
        await speak(call, samples, played)
        await call.wait_for(of_type("input_audio_buffer.speech_stopped"), 60)
        assert call.types().count("input_audio_buffer.speech_started") == 1
        assert call.types().count("input_audio_buffer.speech_stopped") == 1
    finally:
        await call.close()
        await call_registry(app).close_all()


async def test_too_many_calls_then_shutdown_closes_the_call(one_session_server):
    """Last in the module: it stops the server."""
    srv = one_session_server
    call = await connect(srv.url)
    try:
        await call.wait_for(of_type("session.created"), 30)
        with pytest.raises(AssertionError, match="429.*session_limit_reached"):
            await connect(srv.url)
        assert srv.metric("omnirt_sessions_total", transport="webrtc", state="refused") >= 1
        assert srv.metric("omnirt_sessions_active", transport="webrtc") == 1
        await long_answer(call)
        await asyncio.to_thread(srv.stop)  # SIGTERM mid-answer
        assert srv.proc.returncode in (0, -15)  # uvicorn re-raises SIGTERM once shut down
        await until(lambda: call.channel.readyState == "closed", "the data channel to close")
    finally:
        await call.close()
    log = srv.log.read_text()
    assert re.search(r"closing \(server shutting down\) \[session_id=sess_\w+\]", log)  # text log format
    assert re.search(r"webrtc rtc_\w+: closed", log)
    assert "Application shutdown complete" in log and "Traceback" not in log
