"""Engine-level faults, in process on the tiny model: a stage step that raises for one request fails only
that request; admission refuses beyond max_waiting; an unread stream is aborted at its byte bound;
storms of disconnects at random points leave every slot free."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time

import pytest
from faults import MARK, inject

from omnirt.app.audio.rounds import Rounds
from omnirt.app.ops.admission import session_refusal
from omnirt.app.ops.front_end_load import FrontEndLoad
from omnirt.app.ops.lifecycle import Lifecycle
from omnirt.pipeline.api import AudioChunk, EngineOverloaded, Finished, OmniRequest, TextDelta
from tests.conftest import HANG_GUARD_S, until


def make_engine(cfg):
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    eng = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    eng.start()
    return eng


def request(rid: str, text: str, audio: bool = True, frames: int = 24, exact: bool = False) -> OmniRequest:
    """`exact`: exactly `frames` codec frames (no early stop), for tests that need a long answer."""
    talker = {"max_tokens": frames, "min_tokens": frames} if exact else {"max_tokens": frames}
    return OmniRequest(rid, [{"role": "user", "content": text}], ("text", "audio") if audio else ("text",),
                       thinker_sampling={"max_tokens": 12}, talker_sampling=talker)


async def collect(engine, req: OmniRequest) -> tuple[str, bytes, Finished]:
    text, pcm, fin = [], bytearray(), None
    async for ev in await engine.submit(req):
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, AudioChunk):
            pcm += ev.pcm16
        elif isinstance(ev, Finished):
            fin = ev
    return "".join(text), bytes(pcm), fin


async def wait_idle(engine) -> None:
    await until(lambda: engine.num_free_slots() == engine.num_slots() and engine.num_active_requests == 0
                and all(not s.requests for s in engine.stages), "every slot free, no request left")


@pytest.fixture(scope="module", params=[("thinker", 3), ("talker", 4), ("code2wav", 1)], ids=lambda p: p[0])
def faulty_engine(request, tiny_config):
    eng = make_engine(tiny_config)
    inject(eng, *request.param)
    eng.fault_stage = request.param[0]
    yield eng
    eng.stop()


PROMPTS = ["Tell me about the sea.", "What is two plus two?", "Sing a short song.", "Name a colour."]


async def test_injected_failure_fails_only_that_request(faulty_engine, caplog):
    """The marked request shares batches with three others; it ends with an error event, they finish
    exactly as they do when run alone."""
    caplog.set_level(logging.WARNING, logger="omnirt.pipeline.stage.loop")
    alone = [await collect(faulty_engine, request(f"alone-{i}", p)) for i, p in enumerate(PROMPTS)]
    stage = faulty_engine.fault_stage
    for attempt in range(6):  # batching depends on timing: retry until the fault hit a shared batch
        reqs = [request(f"mixed-{attempt}-{i}", p) for i, p in enumerate(PROMPTS)]
        bad = request(f"{MARK}{attempt}", "Tell me about the sea.")
        results = await asyncio.gather(*(collect(faulty_engine, r) for r in [*reqs[:2], bad, *reqs[2:]]))
        results.insert(0, results.pop(2))
        _, _, fin_bad = results[0]
        assert fin_bad.finish_reason == "error" and stage in fin_bad.error and "Traceback" not in fin_bad.error
        for (text, pcm, fin), (text_a, pcm_a, fin_a) in zip(results[1:], alone):
            assert fin.finish_reason == fin_a.finish_reason != "error"
            assert text == text_a and len(pcm) == len(pcm_a) > 0
            assert len(pcm) // 2 == fin.usage.audio_frames * 1920 - 555  # every packet of the response arrived
        if any("retrying its halves" in r.getMessage() for r in caplog.records):
            break
    assert any("retrying its halves" in r.getMessage() for r in caplog.records)  # it failed inside a batch
    await wait_idle(faulty_engine)


async def test_admission_refuses_beyond_max_waiting(tiny_config):
    stages = tuple(dataclasses.replace(s, max_num_seqs=2, max_waiting=1) for s in tiny_config.stages)
    eng = make_engine(dataclasses.replace(tiny_config, stages=stages, retry_after_s=2.0))
    try:
        running = [await eng.submit(request(f"adm-{i}", "Talk for a while.", frames=60, exact=True)) for i in range(3)]
        with pytest.raises(EngineOverloaded) as exc:
            await eng.submit(request("adm-over", "One more?"))
        assert exc.value.retry_after_s == 2.0 and exc.value.capacity == 3
        with pytest.raises(EngineOverloaded):
            eng.check_admission(wants_audio=True)
        lifecycle, load = Lifecycle(eng, deadline_s=1.0), FrontEndLoad(None, Rounds(lambda jobs: None, "idle"))
        code, reason = session_refusal(eng, lifecycle, load)  # what a realtime endpoint answers at connect now
        assert code == 1013 and "capacity" in reason and len(reason.encode()) <= 123
        assert eng.admission.num_waiting("thinker") == 1
        fins = []
        for events in running:  # the admitted ones all finish, the waiting one included
            fins += [ev async for ev in events if isinstance(ev, Finished)]
        assert [f.finish_reason for f in fins] == ["length"] * 3
        eng.check_admission(wants_audio=True)  # room again
        assert session_refusal(eng, lifecycle, load) is None
        lifecycle.is_draining = True
        assert session_refusal(eng, lifecycle, load) == (1001, "server shutting down")
        assert eng.admission.num_admitted == dict.fromkeys(eng.admission.limits, 0)
    finally:
        eng.stop()


async def test_unread_stream_is_aborted_at_its_buffer_bound(tiny_config):
    eng = make_engine(dataclasses.replace(tiny_config, max_output_buffer_bytes=64 * 1024))
    try:
        events = await eng.submit(request("unread", "Talk for a long time.", frames=600, exact=True))
        await wait_idle(eng)  # nobody reads: the engine frees it all by itself
        kinds = [ev async for ev in events]
        fin = kinds[-1]
        assert isinstance(fin, Finished) and fin.finish_reason == "abort" and "output buffer full" in fin.error
        audio = sum(len(e.pcm16) for e in kinds if isinstance(e, AudioChunk))
        assert 0 < audio <= 64 * 1024 + 2 * 48000  # held at most the bound plus the chunk that crossed it
    finally:
        eng.stop()


@pytest.mark.timeout(1800)  # the storm's own guard is progress, below; this one only ends a stuck test
async def test_disconnect_storm_frees_every_slot(engine):
    """Thousands of requests, each dropped at a random point (before the first event, mid text, mid
    audio, or after the end); none hangs; afterwards every stage has every slot free."""
    rng = random.Random(0)
    num, concurrency, started = int(os.environ.get("OMNIRT_STORM_N", "1000")), 48, time.monotonic()
    gate, ended = asyncio.Semaphore(concurrency), []

    async def one(i: int) -> None:
        async with gate:
            events = await engine.submit(request(f"storm-{i}", f"storm {i}", audio=rng.random() < 0.7, frames=40))
            stop_after = rng.choice([0, 1, 2, 5, 10_000])
            n = 0
            async for _ in events:
                n += 1
                if n >= stop_after:
                    break
            await events.aclose()
        ended.append(i)

    # a guard against a hang, not a bound on the storm's time (a loaded machine takes long): requests keep ending
    storm, seen = asyncio.gather(*(one(i) for i in range(num))), -1
    while not storm.done():
        assert len(ended) > seen, f"no request ended in {HANG_GUARD_S} s: {len(ended)}/{num}"
        seen = len(ended)
        await asyncio.wait([storm], timeout=HANG_GUARD_S)
    await storm
    await wait_idle(engine)
    assert engine.admission.num_admitted == dict.fromkeys(engine.admission.limits, 0)
    print(f"disconnect storm: {num} requests in {time.monotonic() - started:.1f} s")
