"""`omnirt serve` with the multi-replica profile, scaled from the command line; and the Ray flag
without Ray installed."""

from __future__ import annotations

import base64
import json
import sys

import openai
import pytest

from tests.conftest import ServerProcess, replica_pids, wait_for
from tests.sse_client import pcm_samples_for_frames

pytestmark = pytest.mark.timeout(300)


def test_serve_multi_replica_profile_with_stage_override():
    srv = ServerProcess(["--model", "tiny", "--deploy-config", "qwen3_omni_moe_multi_replicas",
                         "--stage-overrides", json.dumps({"1": {"num_replicas": 3}})])
    try:
        wait_for(lambda: len(replica_pids(srv)) == 5, "three talker and two code2wav workers listed")
        replicas = srv.health()["replicas"]
        assert [r["device"] for r in replicas["talker"]] == [1, 2, 1]
        assert len(replicas["code2wav"]) == 2 and replicas["thinker"][0]["kind"] == "inline"
        assert all(r["kind"] == "process" and r["state"] == "up" and r["pid"]
                   for r in replicas["talker"] + replicas["code2wav"])
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        # the profile samples the talker (T=0.9, top_k 50): random weights can end after a frame or two
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=8,
                                           modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
                                           extra_body={"talker_sampling": {"min_tokens": 6}})
        wav = base64.b64decode(r.choices[0].message.audio.data)
        frames = r.usage.completion_tokens_details.audio_tokens
        assert wav[:4] == b"RIFF" and frames >= 6 and len(wav) == 44 + 2 * pcm_samples_for_frames(frames)
        # the engine core's stats reach the API process a little after it answers (a snapshot every 0.2 s, later on
        # a loaded machine): the first idle answer may predate the request's steps
        wait_for(lambda: sum(x["steps"] for x in srv.health()["replicas"]["talker"]) > 0, "the talker replicas' steps")
        after = srv.wait_idle()
        assert after["free_slots"] == after["slots"] and after["slots"]["talker"] == 3 * 4  # 3 replicas x 4 seqs
    finally:
        srv.stop()


def test_distributed_ray_without_ray_is_a_clear_error(monkeypatch):
    from omnirt.app.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if the omnirt[ray] extra were not installed
    with pytest.raises(SystemExit, match=r"distributed: ray needs Ray.*pip install 'omnirt\[ray\]'"):
        main(["serve", "--distributed", "ray", "--threads", "1", "--engine-process", "inproc"])
