"""Stage replicas in worker processes: 2x Talker + 2x Code2Wav give the in-process engine's outputs,
spread the load, keep each request on one replica, and survive a replica being killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import jsonschema
import pytest
from replica_helpers import (
    PROMPTS,
    Routing,
    kill,
    max_pcm_diff,
    pooled_config,
    replica,
    run,
    start_engine,
    wait_for,
)

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.replicas.pool import ReplicaPool
from omnirt.pipeline.replicas.worker import ReplicaLoad, StepReport, WorkerSpec
from omnirt.pipeline.stage.messages import Command, StageMessage

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pooled():
    eng = start_engine(pooled_config())
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def baseline(engine):
    """The in-process engine's results for PROMPTS, one at a time."""
    async def go():
        return [await run(engine, f"base-{i}", t) for i, t in enumerate(PROMPTS)]
    return asyncio.run(go())


async def test_replicas_match_in_process_spread_and_stick(pooled, baseline):
    routing = Routing()
    routing.install(pooled)
    results = await asyncio.wait_for(asyncio.gather(*(run(pooled, f"par-{i}", t) for i, t in enumerate(PROMPTS))),
                                     120)
    for base, got in zip(baseline, results):
        assert got.finish.finish_reason == base.finish.finish_reason and got.finish.error is None
        assert got.text == base.text and len(got.pcm) == len(base.pcm) > 0
        assert max_pcm_diff(base.pcm, got.pcm) <= 2  # batched float math may differ in the last bits
    for stage in ("talker", "code2wav"):
        owners = [routing.replicas_of(stage, f"par-{i}") for i in range(len(PROMPTS))]
        assert all(len(o) == 1 for o in owners), f"{stage}: a request was served by two replicas: {owners}"
        per_replica = [sum(o == {r} for o in owners) for r in (0, 1)]
        assert min(per_replica) >= 2, f"{stage}: load did not spread: {per_replica}"
    # hand-off payloads crossed through shared memory, nothing inline through the pipe
    inboxes = [slot.handle.inbox.stats for slot in pooled.stage("talker")._slots]
    assert all(s.num_shm_bytes > 0 and s.num_inline_bytes == 0 for s in inboxes)
    await wait_for(lambda: not pooled.stage("talker").requests and not pooled.stage("code2wav").requests, 10,
                   "pools to drain")


async def test_killed_replica_fails_its_requests_others_finish_and_it_returns(pooled):
    started = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(run(pooled, f"kill-{i}", PROMPTS[i], talker_tokens=160, min_tokens=160,
                                     started=started[i])) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    victims = {rid for rid, idx in pooled.stage("talker").requests.items() if idx == 0}
    assert victims and len(victims) < 4
    old_pid = replica(pooled, "talker", 0)["pid"]
    kill(old_pid)
    await wait_for(lambda: replica(pooled, "talker", 0)["state"] != "up", 60, "the death to be noticed")
    # noticed by polling the process (every 0.2 s), not by the 10 s silence that ends a hung worker
    assert "exited with code -9" in replica(pooled, "talker", 0)["last_error"]
    results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
    for i, res in enumerate(results):
        if f"kill-{i}" in victims:
            assert res.finish.finish_reason == "error" and "talker replica 0 died" in res.finish.error
        else:
            assert res.finish.finish_reason == "length" and res.finish.error is None
            assert res.finish.usage.audio_frames >= 159 and len(res.pcm) // 2 >= 150 * 1920  # all of its speech
    await wait_for(lambda: replica(pooled, "talker", 0)["state"] == "up", 120, "the replica to restart")
    status = replica(pooled, "talker", 0)
    assert status["restarts"] == 1 and status["pid"] != old_pid
    routing = Routing()
    routing.install(pooled)
    again = await asyncio.wait_for(asyncio.gather(*(run(pooled, f"after-{i}", PROMPTS[i]) for i in range(2))), 120)
    assert all(r.finish.finish_reason == "length" and r.pcm for r in again)
    assert {0} in [routing.replicas_of("talker", f"after-{i}") for i in range(2)]  # the new replica serves


async def test_hung_replica_is_killed_and_its_unanswered_request_retried(pooled, baseline, monkeypatch):
    import omnirt.pipeline.replicas.worker

    monkeypatch.setattr(omnirt.pipeline.replicas.worker, "HANG_TIMEOUT_S", 3.0)
    await wait_for(lambda: all(r["state"] == "up" for r in pooled.replica_status()["talker"]), 120, "replicas up")
    pid = replica(pooled, "talker", 0)["pid"]
    os.kill(pid, signal.SIGSTOP)  # replica 0 takes the request (both idle: lowest index) but never answers
    try:
        task = asyncio.create_task(run(pooled, "retry-0", PROMPTS[0]))
        await wait_for(lambda: pooled.stage("talker").requests.get("retry-0") == 0, 30,
                       "the request to reach replica 0")
        # the pool kills the silent process after HANG_TIMEOUT_S, then replays the request on replica 1
        await wait_for(lambda: replica(pooled, "talker", 0)["state"] == "dead", 120, "the hang to be detected")
        assert "exited with code -9" in replica(pooled, "talker", 0)["last_error"]
    finally:
        handle = pooled.stage("talker")._slots[0].handle
        if handle.pid == pid and handle.process.is_alive():
            kill(pid)
    res = await asyncio.wait_for(task, 120)
    base = baseline[0]
    assert res.finish.finish_reason == base.finish.finish_reason and res.text == base.text
    assert len(res.pcm) == len(base.pcm) and max_pcm_diff(res.pcm, base.pcm) <= 2
    await wait_for(lambda: replica(pooled, "talker", 0)["state"] == "up", 120, "the replica to restart")


class _Recorder:
    """A replica that only records what it is sent, for the routing policy alone."""

    kind = "test"
    pid = None

    def __init__(self, spec, on_report, on_death):
        self.spec, self.on_report, self.sent = spec, on_report, []

    def start(self):
        self.on_report(self, StepReport(load=ReplicaLoad(), is_ready=True))

    def send(self, msg):
        self.sent.append(msg.request_id)

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("routing,expected", [("round_robin", [3, 3, 3]), ("least_loaded", [3, 3, 3])])
def test_routing_policies(routing, expected):
    from omnirt.pipeline.config import EngineConfig

    specs = [WorkerSpec("code2wav", i, i, EngineConfig()) for i in range(3)]
    pool = ReplicaPool("code2wav", specs, on_step=lambda *a: None, routing=routing, replica_cls=_Recorder)
    pool.start()
    for i in range(9):
        pool.send(StageMessage(Command.ADD, f"r{i}"))
        pool.send(StageMessage(Command.INPUT, f"r{i}", [0] * 16))
    counts = [len({rid for rid in slot.handle.sent}) for slot in pool._slots]
    assert counts == expected
    for slot in pool._slots:  # sticky: every message of a request went to the replica that got its ADD
        assert all(slot.handle.sent.count(rid) == 2 for rid in slot.handle.sent)
    # least-loaded skips a busy replica; round-robin does not
    pool._slots[0].num_sent += 100  # 100 unapplied messages queued at replica 0
    pool.send(StageMessage(Command.ADD, "busy"))
    got = [i for i, slot in enumerate(pool._slots) if "busy" in slot.handle.sent]
    assert got == ([0] if routing == "round_robin" else [1])
    pool.stop()
    assert all(slot.handle.stopped for slot in pool._slots)


async def test_thinker_in_a_worker_process_matches_in_process(baseline):
    """Any stage can leave the engine's process: here the Thinker (prompt ids in, rows out)."""
    from replica_helpers import ROOT

    from tests.profiles import load_profile

    eng = start_engine(load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu", {}, {"0": {"devices": "1"}}))
    try:
        assert eng.replica_status()["thinker"][0]["kind"] == "process"
        got = await asyncio.wait_for(asyncio.gather(*(run(eng, f"th-{i}", t) for i, t in enumerate(PROMPTS[:3]))), 120)
        for base, res in zip(baseline, got):
            assert res.text == base.text and res.finish.finish_reason == base.finish.finish_reason
            assert len(res.pcm) == len(base.pcm) and max_pcm_diff(res.pcm, base.pcm) <= 2
        # the prompt goes as token ids: the Thinker embeds it (and encodes audio) in its own process
        assert eng.stage("thinker")._slots[0].handle.inbox.stats.num_shm_bytes == 0
        # a compiled grammar crosses too (as its serialized JSON) and constrains the worker's sampling
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 99}},
                  "required": ["ok", "n"], "additionalProperties": False}
        req = OmniRequest("th-json", [{"role": "user", "content": "JSON"}], thinker_sampling={"max_tokens": 60},
                          response_format={"type": "json_schema", "schema": schema})
        reply = await asyncio.wait_for(collect_reply(await eng.submit(req)), 120)
        jsonschema.validate(json.loads(reply.text), schema)
    finally:
        eng.stop()


async def test_talker_in_its_own_process_on_the_engine_device(baseline):
    """`own_process`: one replica on device 0, in a worker process (the process boundary alone)."""
    from replica_helpers import ROOT

    from tests.profiles import load_profile

    eng = start_engine(load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu", {}, {"1": {"own_process": True}}))
    try:
        status = eng.replica_status()
        assert status["talker"][0]["kind"] == "process" and status["code2wav"][0]["kind"] == "inline"
        got = await asyncio.wait_for(asyncio.gather(*(run(eng, f"own-{i}", t) for i, t in enumerate(PROMPTS[:2]))), 120)
        for base, res in zip(baseline, got):
            assert res.text == base.text and len(res.pcm) == len(base.pcm) and max_pcm_diff(res.pcm, base.pcm) <= 2
        # one hand-off message per Thinker step for both requests (+ an add and an input-done each)
        inbox = eng.stage("talker")._slots[0].handle.inbox.stats
        assert inbox.num_messages <= eng.stage("thinker").counters.num_steps + 2 * 2
    finally:
        eng.stop()


def test_a_process_loads_only_its_own_stages(tiny_config):
    """A Code2Wav replica holds no Thinker or Talker weights; a Talker replica still gets the Thinker's
    three marker rows it reads (the rest of the Thinker is never materialised)."""
    import torch

    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    cpu = get_platform("cpu")
    full = load_models(tiny_config, cpu)
    c2w, talker = load_models(tiny_config, cpu, ("code2wav",)), load_models(tiny_config, cpu, ("talker",))
    assert c2w.thinker is None and c2w.talker is None and c2w.code2wav is not None
    assert all(p.is_meta for p in c2w.hf.talker.parameters())
    table = c2w.hf.thinker.get_input_embeddings().weight
    assert [p for p in c2w.hf.thinker.parameters() if not p.is_meta] == [table]
    assert talker.thinker is None and talker.code2wav is None
    assert all(p.is_meta for p in talker.hf.code2wav.parameters())
    assert torch.equal(talker.talker.tts_bos, full.talker.tts_bos)
    assert torch.equal(talker.talker.tts_pad, full.talker.tts_pad)
    assert set(c2w.kv_bytes) == set() and set(talker.kv_bytes) == {"talker"}
