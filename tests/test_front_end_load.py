"""Full before late: the front end's load signal (event-loop lag, the VAD's backlog) on an injected clock, the
profile's `front_end` limits, `--api-workers auto`; and against a real server, sessions ramped until the load
refuses new ones (WebSocket: an `error` event `server_busy` and close 1013; WebRTC: 503 with Retry-After) while
every session admitted before stays open and has its speech, sent while the server was loaded, turned into
turns."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest
import websockets

from omnirt.app import cli
from omnirt.app.audio.rounds import Rounds
from omnirt.app.ops.front_end_load import FrontEndLoad
from omnirt.pipeline import profile
from omnirt.pipeline.api import FrontEndLimits
from omnirt.pipeline.config import FrontEndConfig, ProfileError
from omnirt.pipeline.models.qwen3_omni.stages import STAGES
from tests.conftest import HANG_GUARD_S, ROOT, ServerProcess, until, wait_for
from tests.realtime_helpers import b64_chunks, espeak_utterance, recv, recv_type, ws_url


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class IdleBacklog:
    num_waiting = 0

    def oldest_wait_s(self) -> float:
        return 0.0


async def probe_with_lags(load: FrontEndLoad, clock: FakeClock, lags_s: list[float]) -> None:
    """Run `load`'s probe over one wake-up per lag: each sleep ends `lag` after it was due."""
    wakes = iter(lags_s)

    async def late_sleep(interval_s: float) -> None:
        try:
            clock.now += interval_s + next(wakes)
        except StopIteration:
            raise asyncio.CancelledError from None

    load._sleep = late_sleep
    with pytest.raises(asyncio.CancelledError):
        await load.probe()


async def test_loop_lag_is_smoothed_and_refuses_past_the_limit_then_admits_again():
    clock = FakeClock()
    load = FrontEndLoad(FrontEndLimits(max_loop_lag_ms=100), IdleBacklog(), clock)
    await probe_with_lags(load, clock, [0.0] * 5)
    assert load.loop_lag_s == pytest.approx(0.0, abs=1e-9) and load.refusal() is None and load.figures().is_admitting
    await probe_with_lags(load, clock, [0.3])  # one late wake-up (a pause) moves the average a fifth of the way
    assert load.loop_lag_s == pytest.approx(0.06) and load.refusal() is None
    await probe_with_lags(load, clock, [0.3])  # a loop that stays late is past the limit on the next probe
    assert load.loop_lag_s == pytest.approx(0.108)
    assert "event loop runs 108 ms late; the limit is 100 ms" in load.refusal()
    assert load.figures().as_json() == {"loop_lag_ms": 108.0, "vad_backlog_ms": 0.0, "vad_waiting": 0,
                                        "admitting": False}
    await probe_with_lags(load, clock, [0.0])
    assert load.loop_lag_s == pytest.approx(0.0864) and load.refusal() is None
    await probe_with_lags(load, clock, [-0.001])  # a wake-up a hair early counts as on time
    assert load.loop_lag_s == pytest.approx(0.0864 * 0.8)


async def test_no_limits_measure_but_never_refuse():
    clock = FakeClock()
    load = FrontEndLoad(None, IdleBacklog(), clock)
    await probe_with_lags(load, clock, [5.0] * 20)
    assert load.loop_lag_s > 4.9 and load.refusal() is None and load.figures().is_admitting


async def test_vad_backlog_is_the_oldest_waiting_audio_and_refuses_past_its_limit():
    """Rounds on a held thread: the jobs queued behind a running round wait; the load reads how long the oldest
    has waited and how many wait, and refuses once the smoothed wait passes the limit."""
    clock, release = FakeClock(), threading.Event()
    rounds = Rounds(lambda jobs: release.wait(), "test-held", clock=clock)
    load = FrontEndLoad(FrontEndLimits(max_vad_backlog_ms=50), rounds, clock)

    class Job:
        def is_pending(self) -> bool:
            return False

        def result(self) -> str:
            return "done"

    first = asyncio.create_task(rounds.submit(Job()))
    await until(lambda: rounds.num_waiting == 1, "the first job in a round")
    clock.now = 1.0
    later = [asyncio.create_task(rounds.submit(Job())) for _ in range(3)]
    await until(lambda: rounds.num_waiting == 4, "three jobs queued behind the round")
    clock.now = 1.2
    assert rounds.oldest_wait_s() == pytest.approx(1.2)  # the running round's job, submitted at 0.0
    load.observe(0.0)
    assert load.vad_backlog_s == pytest.approx(0.24) and load.figures().vad_waiting == 4
    assert "audio waits for the VAD 240 ms late; the limit is 50 ms" in load.refusal()
    release.set()
    assert await asyncio.gather(first, *later) == ["done"] * 4
    assert rounds.num_waiting == 0 and rounds.oldest_wait_s() == 0.0
    load.observe(0.0)
    assert load.vad_backlog_s == pytest.approx(0.192)


def front_end_of(*settings: str) -> FrontEndConfig:
    """The tiny profile's `front_end`, with `--set` settings over it."""
    return profile.load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu", STAGES,
                                [profile.parse_setting(s) for s in settings]).front_end


def test_profile_front_end_limits_and_their_checks():
    assert front_end_of() == FrontEndConfig(max_loop_lag_ms=100.0, max_vad_backlog_ms=200.0)  # on by default
    assert front_end_of("front_end.max_loop_lag_ms=null", "front_end.max_vad_backlog_ms=50") == FrontEndConfig(
        max_loop_lag_ms=None, max_vad_backlog_ms=50)
    with pytest.raises(ProfileError, match=r"front_end\.max_loop_lag_ms must be > 0 or null"):
        front_end_of("front_end.max_loop_lag_ms=0")
    with pytest.raises(ProfileError, match=r"front_end\.max_lag is not a known key"):
        front_end_of("front_end.max_lag=5")


@pytest.mark.parametrize(("cores", "process", "workers"), [(2, "auto", 1), (4, "core", 1), (8, "auto", 2),
                                                            (16, "auto", 4), (128, "auto", 8), (16, "inproc", 1)])
def test_api_workers_auto_from_the_cores(monkeypatch, caplog, cores, process, workers):
    monkeypatch.setattr(cli, "host_cores", lambda: cores)
    monkeypatch.setattr(cli.sys, "platform", "linux")
    with caplog.at_level("INFO", "omnirt.app.cli"):
        assert cli.auto_api_workers(process) == workers
    assert f"--api-workers auto: {workers} API worker" in caplog.text


@pytest.fixture(scope="module")
def utterance(tmp_path_factory) -> list[str]:
    samples, _ = espeak_utterance(tmp_path_factory.mktemp("speech"), "Please tell me about the sea.")
    return b64_chunks(samples, chunk_ms=20)


NUM_ADMITTED, NUM_REFUSED = 4, 3
TURNS = {"type": "server_vad", "create_response": False}  # the VAD's turns only: no response to wait for


async def open_session(srv: ServerProcess):
    ws = await websockets.connect(ws_url(srv))
    await recv_type(ws, "session.created")
    await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": TURNS}}}}))
    await recv_type(ws, "session.updated")
    return ws


async def refused_at_connect(srv: ServerProcess) -> tuple[dict, int]:
    async with websockets.connect(ws_url(srv), open_timeout=HANG_GUARD_S) as ws:  # the loaded loop answers late
        err = await recv(ws)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws)
    return err, closed.value.rcvd.code


async def turn_events(ws) -> list[str]:
    """The session's events up to its committed turn: none may be an error."""
    kinds = [(await recv(ws))["type"]]
    while kinds[-1] != "input_audio_buffer.committed":
        kinds.append((await recv(ws))["type"])
    return kinds


@pytest.mark.timeout(300)
async def test_sessions_ramp_until_the_load_refuses_and_the_admitted_keep_their_audio(utterance):
    srv = ServerProcess(["--set", "front_end.max_loop_lag_ms=200", "--set", "front_end.max_vad_backlog_ms=null"],
                        module="tests.loaded_server")
    admitted = []
    try:
        for _ in range(NUM_ADMITTED):  # an idle front end admits
            admitted.append(await open_session(srv))
        assert srv.health()["front_end"]["admitting"]
        srv.proc.send_signal(signal.SIGUSR2)  # the loop loaded from here (tests/loaded_server.py)
        senders = [asyncio.create_task(send_all(ws, utterance)) for ws in admitted]  # spoken while it is loaded
        await asyncio.to_thread(wait_for, lambda: not srv.health()["front_end"]["admitting"], "the load refusing")
        for _ in range(NUM_REFUSED):
            err, code = await refused_at_connect(srv)
            assert code == 1013 and err["type"] == "error", err
            assert err["error"]["code"] == "server_busy" and err["error"]["type"] == "server_error"
            assert "front end is at capacity (the event loop runs" in err["error"]["message"]
        call = httpx.post(f"{srv.url}/v1/realtime/calls", content="v=0\r\n", timeout=60,
                          headers={"Content-Type": "application/sdp"})
        assert call.status_code == 503 and int(call.headers["Retry-After"]) >= 1, call.text
        assert call.json()["error"]["code"] == "server_busy" and call.json()["error"]["type"] == "server_error"
        health = srv.health()
        assert health["front_end"]["loop_lag_ms"] > 200 and srv.metric("omnirt_front_end_admitting") == 0
        assert srv.metric("omnirt_sessions_total", state="refused") == NUM_REFUSED + 1
        srv.proc.send_signal(signal.SIGUSR2)  # the load off
        await asyncio.gather(*senders)
        for kinds in await asyncio.gather(*(turn_events(ws) for ws in admitted)):  # no audio of theirs was lost
            assert kinds.count("input_audio_buffer.speech_started") == 1 and "error" not in kinds, kinds
            assert "input_audio_buffer.speech_stopped" in kinds, kinds
        await asyncio.to_thread(wait_for, lambda: srv.health()["front_end"]["admitting"], "admitting again")
        admitted.append(await open_session(srv))
        assert srv.metric("omnirt_sessions_active", transport="websocket") == NUM_ADMITTED + 1  # none dropped
    finally:
        for ws in admitted:
            await ws.close()
        srv.stop()


async def send_all(ws, chunks: list[str]) -> None:
    for chunk in chunks:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
