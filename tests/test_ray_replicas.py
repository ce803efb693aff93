"""The same replica pools as Ray actors on a local, loopback-only Ray instance with 2 CPUs."""

from __future__ import annotations

import asyncio
import os

import pytest
from replica_helpers import PROMPTS, Routing, kill, max_pcm_diff, pooled_config, replica, run, start_engine, wait_for

pytestmark = pytest.mark.timeout(400)
# Loopback only: Ray otherwise binds its node to the address of the default route's interface.
# This switch (named for Windows/macOS, read when Ray is imported) makes it use 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report to Anyscale
ray = pytest.importorskip("ray", reason="Ray is the optional extra omnirt[ray]")


@pytest.fixture(scope="module")
def ray_engine():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", object_store_memory=80 * 2**20,
             log_to_driver=False)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    eng = start_engine(pooled_config({"distributed": "ray"}, ray_resources={"num_cpus": 0.5}))
    yield eng
    eng.stop()
    ray.shutdown()


async def test_ray_replicas_match_in_process_and_stick(ray_engine, engine):
    routing = Routing()
    routing.install(ray_engine)
    texts = PROMPTS[:4]
    base = [await run(engine, f"rbase-{i}", t) for i, t in enumerate(texts)]
    got = await asyncio.wait_for(asyncio.gather(*(run(ray_engine, f"ray-{i}", t) for i, t in enumerate(texts))), 120)
    for b, g in zip(base, got):
        assert g.finish.finish_reason == b.finish.finish_reason and g.text == b.text
        assert len(g.pcm) == len(b.pcm) > 0 and max_pcm_diff(b.pcm, g.pcm) <= 2
    for stage in ("talker", "code2wav"):
        owners = [routing.replicas_of(stage, f"ray-{i}") for i in range(len(texts))]
        assert all(len(o) == 1 for o in owners) and set().union(*owners) == {0, 1}
    assert all(r["kind"] == "ray" and r["state"] == "up" for r in ray_engine.replica_status()["talker"])


async def test_ray_actor_killed_mid_stream(ray_engine):
    started = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(run(ray_engine, f"rk-{i}", PROMPTS[i], talker_tokens=120, min_tokens=120,
                                     started=started[i])) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    victims = {rid for rid, idx in ray_engine.stage("code2wav").requests.items() if idx == 1}
    assert victims and len(victims) < 4
    old_pid = replica(ray_engine, "code2wav", 1)["pid"]
    kill(old_pid)  # the actor's worker process, as a crash would
    await wait_for(lambda: replica(ray_engine, "code2wav", 1)["state"] != "up", 60, "actor death")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
    for i, res in enumerate(results):
        if f"rk-{i}" in victims:
            assert res.finish.finish_reason == "error" and "code2wav replica 1 died" in res.finish.error
        else:
            assert res.finish.finish_reason == "length" and res.finish.error is None
    await wait_for(lambda: replica(ray_engine, "code2wav", 1)["state"] == "up", 120, "a new actor")
    assert replica(ray_engine, "code2wav", 1)["restarts"] == 1
    routing = Routing()
    routing.install(ray_engine)
    again = await asyncio.wait_for(asyncio.gather(*(run(ray_engine, f"rafter-{i}", PROMPTS[i]) for i in range(2))),
                                   120)
    assert all(r.finish.finish_reason == "length" and r.pcm for r in again)
    assert {1} in [routing.replicas_of("code2wav", f"rafter-{i}") for i in range(2)]
