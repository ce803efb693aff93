"""The engine API (`omnirt/pipeline/api.py`) with the engine in this process and in an engine core process of
its own: the same behaviour through both clients, the process boundary's failure modes (a core that
dies mid-stream, refusals, aborts racing last steps), and the dependency rule that makes the API the
only door."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
from pathlib import Path

import pytest

from omnirt.pipeline.api import (
    AudioChunk,
    EngineDeadError,
    EngineOptions,
    EngineOverloaded,
    Finished,
    OmniRequest,
    RequestError,
    TextDelta,
    collect_reply,
    start_engine,
)
from tests.conftest import until

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["inproc", "core"]


def request(rid: str, text: str = "Tell me about the sea.", audio: bool = True, frames: int = 20,
            thinker: dict | None = None, **extra) -> OmniRequest:
    return OmniRequest(rid, [{"role": "user", "content": text}], ("text", "audio") if audio else ("text",),
                       thinker_sampling={"max_tokens": 10, **(thinker or {})}, talker_sampling={"max_tokens": frames},
                       **extra)


@pytest.fixture(scope="module")
def clients():
    started = {kind: start_engine(EngineOptions(process=kind, threads=1)) for kind in KINDS}
    yield started
    for client in started.values():
        client.stop()


@pytest.fixture(params=KINDS)
def client(request, clients):
    return clients[request.param]


async def wait_idle(client) -> None:
    """Until every slot is free again (the core's stats arrive every 0.2 s)."""
    def idle() -> bool:
        stats = client.stats()
        return client.num_active_requests == 0 and stats.active_requests == 0 and \
            all(s.free_slots == s.slots for s in stats.stages)
    await until(idle, "every slot free, no request left")


# ---- the same behaviour through both clients ------------------------------------------------------------


async def test_both_clients_give_the_same_reply(clients):
    """Greedy text, token ids and every PCM sample are equal in process and across the process boundary,
    and the audio holds exactly the frames the usage reports."""
    replies = {k: await collect_reply(await c.submit(request(f"same-{k}", frames=24))) for k, c in clients.items()}
    a, b = replies["inproc"], replies["core"]
    assert a.text == b.text and a.token_ids == b.token_ids and a.pcm16 == b.pcm16
    assert a.finished.usage == b.finished.usage
    assert len(b.pcm16) // 2 == b.finished.usage.audio_frames * 1920 - 555 > 0


async def test_audio_input_crosses_the_boundary(clients):
    """A user message with audio (a numpy array) reaches the core intact: same reply as in process."""
    import numpy as np

    tone = (0.3 * np.sin(np.arange(16000) * 2 * np.pi * 220 / 16000)).astype(np.float32)
    msgs = [{"role": "user", "content": [{"type": "audio", "audio": tone}, {"type": "text", "text": "What?"}]}]
    replies = {}
    for kind, c in clients.items():
        req = OmniRequest(f"audio-in-{kind}", msgs, ("text",), thinker_sampling={"max_tokens": 8})
        replies[kind] = await collect_reply(await c.submit(req))
    text_only = await collect_reply(await clients["core"].submit(request("text-only", "What?", audio=False)))
    assert replies["inproc"].token_ids == replies["core"].token_ids
    # the audio placeholders are in the prompt
    assert replies["core"].finished.usage.prompt_tokens > text_only.finished.usage.prompt_tokens + 2


async def test_a_speculative_prefill_crosses_the_boundary(client):
    """A `prefill_only` request ends with `Finished` alone, and the turn's request reuses what it prefilled."""
    from tests.test_stream_prefill import speech_like, turn

    audio = speech_like(17.5, seed=7)
    assert client.info().num_settled_windows(len(audio)) == 2
    events = [ev async for ev in await client.submit(OmniRequest("spec", turn(audio[:17 * 16000]), prefill_only=True))]
    assert len(events) == 1 and events[0].usage.completion_tokens == 0
    reply = await collect_reply(await client.submit(OmniRequest("spec-turn", turn(audio), ("text",),
                                                                thinker_sampling={"max_tokens": 4})))
    assert reply.finished.usage.cached_tokens == events[0].usage.prompt_tokens > 2 * 104
    await wait_idle(client)


async def test_info(client):
    info = client.info()
    assert info.model == "tiny" and info.default_voice in info.voices and info.has_audio_output
    assert (info.input_sample_rate, info.output_sample_rate) == (16000, 24000)
    assert list(info.stage_limits) == ["thinker", "talker", "code2wav"]
    assert info.stages_for(False) == ("thinker",)


@pytest.mark.parametrize("req, code", [
    (request("bad-voice", voice="nobody"), "invalid_voice"),
    (request("too-long", text="word " * 5000), "context_length_exceeded"),
    (request("bad-sampling", thinker={"temperature": -1.0}), "invalid_request"),
    (request("client-forcing", thinker={"forced": [1, 2]}), "invalid_request"),  # teacher forcing: not a client's
])
async def test_refusals_are_typed(client, req, code):
    with pytest.raises(RequestError) as exc:
        await client.submit(req)
    assert exc.value.code == code
    reply = await collect_reply(await client.submit(request(f"after-{req.request_id}", audio=False)))
    assert reply.finished.finish_reason in ("stop", "length")  # the engine serves the next request
    await wait_idle(client)


async def test_abort_mid_stream_frees_every_slot(client):
    events = await client.submit(request("abort-me", frames=200))
    async for ev in events:
        if isinstance(ev, AudioChunk):
            client.abort("abort-me", "stopped by the test")
        if isinstance(ev, Finished):
            assert ev.finish_reason == "abort" and ev.error == "stopped by the test"
            break
    await wait_idle(client)


async def test_aborts_racing_last_steps_release_admission_once(client):
    """Requests aborted around their own last steps (every point from submit to after the end): each
    stream ends exactly once, and every stage's admission count returns to zero."""
    async def one(i: int) -> Finished:
        events = await client.submit(request(f"race-{i}", frames=2 + i % 6))
        ends, n = [], 0
        async for ev in events:
            n += 1
            if n == 1 + i % 5:
                client.abort(f"race-{i}")
            if isinstance(ev, Finished):
                ends.append(ev)
        assert len(ends) == 1
        return ends[0]

    for round_ in range(3):
        ends = await asyncio.gather(*(one(round_ * 16 + i) for i in range(16)))
        assert {e.finish_reason for e in ends} <= {"abort", "stop", "length"}
    await wait_idle(client)
    client.check_admission(True)  # nothing left counted against any stage


async def test_abort_right_after_submit_is_not_lost(client):
    """An abort that reaches the engine together with its request (before the prompt is even encoded)
    still ends it: no reply runs on unseen, holding a slot."""
    for i in range(5):
        rid = f"early-{i}"
        started = asyncio.create_task(client.submit(request(rid, frames=400)))
        await asyncio.sleep(0)  # the request is on its way
        client.abort(rid, "gone at once")
        ends = [ev async for ev in await started if isinstance(ev, Finished)]
        assert [e.finish_reason for e in ends] == ["abort"]
    await wait_idle(client)


async def test_reader_that_leaves_early_aborts(client):
    """A consumer that stops iterating aborts its request in every stage."""
    events = await client.submit(request("leave", frames=200))
    async for ev in events:
        if isinstance(ev, AudioChunk):
            break
    await events.aclose()
    await wait_idle(client)


# ---- the process boundary --------------------------------------------------------------------------------


@pytest.fixture
def small_core():
    """A core process of its own, one slot and one wait place per stage (this one gets killed)."""
    tiny = {"max_num_seqs": 1, "max_waiting": 1}
    client = start_engine(EngineOptions(process="core", threads=1,
                                        stage_overrides={"0": tiny, "1": tiny, "2": tiny}))
    yield client
    client.stop()


async def test_overload_and_a_core_killed_mid_stream(small_core):
    client = small_core
    running = [await client.submit(request(f"long-{i}", frames=400)) for i in range(2)]
    with pytest.raises(EngineOverloaded):
        client.check_admission(True)
    with pytest.raises(EngineOverloaded):
        await client.submit(request("one-too-many"))
    first = await running[0].__anext__()
    assert isinstance(first, TextDelta | AudioChunk)
    os.kill(client.pid, signal.SIGKILL)
    reason = await asyncio.wait_for(client.wait_dead(), 30)
    assert "exited with code" in reason and not client.health().is_alive
    for events in running:
        ends = [ev async for ev in events if isinstance(ev, Finished)]
        assert len(ends) == 1 and ends[0].finish_reason == "error" and ends[0].error == reason
    assert client.num_active_requests == 0
    with pytest.raises(EngineDeadError):
        await client.submit(request("after-death"))
    ipc_dir = Path(client._owner._dir)
    client.stop()
    assert not ipc_dir.exists()


def test_a_core_that_cannot_start_says_why():
    from omnirt.pipeline.api import EngineStartError

    with pytest.raises(EngineStartError, match="max_num_seqs"):
        start_engine(EngineOptions(process="core", stage_overrides={"0": {"max_num_seqs": 0}}))


# ---- the dependency rule ---------------------------------------------------------------------------------


def _imports(folder: str) -> set[tuple[str, str]]:
    """(file, imported module) for every import in a package, lazy ones included."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                found.update((path.name, alias.name) for alias in node.names)
    return found


def test_app_imports_only_the_engine_api():
    app = _imports("omnirt/app")
    assert app and {(f, m) for f, m in app if m.startswith("omnirt.pipeline") and m != "omnirt.pipeline.api"} == set()
    assert {(f, m) for f, m in app if m.startswith("omnirt.loadtest")} == set()
    pipeline = _imports("omnirt/pipeline")
    above = ("omnirt.app", "omnirt.loadtest", "tests")
    assert pipeline and {(f, m) for f, m in pipeline if m.startswith(above)} == set()
