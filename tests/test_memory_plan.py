"""The memory plan (`omnirt/pipeline/stage/memory_plan.py`): KV slots from the device's memory, per stage or global, and
the start-up error that names the key and the numbers; then the tiny model on the CPU sized by it (host memory
faked at `host_memory`, the one place the CPU platform reads it)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from omnirt.pipeline.api import EngineOptions, EngineStartError, Finished, OmniRequest
from omnirt.pipeline.config import ProfileError
from omnirt.pipeline.stage.memory_plan import GIB, MAX_SLOTS_PER_SEQ, StageMemory, plan_memory


def stages(thinker: float | None = None, talker: float | None = None, grow: bool = True) -> list[StageMemory]:
    """Round numbers: thinker slots 1 GiB, talker slots 0.25 GiB plus a 0.5 GiB code-predictor cache."""
    return [StageMemory("thinker", 0, 4, 1024, 10 * GIB, 2 * GIB, GIB, 0, thinker, grow),
            StageMemory("talker", 1, 4, 1024, 2 * GIB, GIB, GIB // 4, GIB // 2, talker, grow),
            StageMemory("code2wav", 2, 4, 1024, GIB, 4 * GIB)]


def test_a_global_fraction_grows_every_stage_by_one_factor():
    plan = plan_memory(stages(), free_bytes=80 * GIB, total_bytes=100 * GIB, fraction=0.3, device="cuda:0")
    # 30 GiB - 20 GiB of weights and workspace leave 10; 0.5 of it is the predictor's, the rest grows
    # (max_num_seqs + 1 scratch) slots by (10 - 0.5) / (5 * 1 + 5 * 0.25) = 1.52
    assert plan.num_slots == {"thinker": 6, "talker": 6, "code2wav": 0}
    assert plan.kv_bytes("thinker") == 7 * GIB and plan.kv_bytes("talker") == 7 * GIB // 4 + GIB // 2
    assert plan.new_bytes == 7 * GIB + 9 * GIB // 4 + 7 * GIB and plan.headroom_bytes == 80 * GIB - plan.new_bytes
    text = "\n".join(plan.lines())
    assert "gpu_memory_utilization 0.3 = 30.00 GiB" in text and "KV 6 slots x 1024 tokens = 7.00 GiB" in text
    assert "code2wav weights 1.00 GiB, no KV cache, graphs/workspace 4.00 GiB" in text


def test_stage_fractions_take_their_share_and_the_rest_shares_the_global_one():
    plan = plan_memory(stages(thinker=0.2), free_bytes=80 * GIB, total_bytes=100 * GIB, fraction=0.3,
                       device="cuda:0")
    # thinker: 20 - 12 = 8 GiB of room: 8 / 5 slots -> 7 slots (8 with the scratch one); the others share 10 GiB:
    # 10 - 8 = 2 GiB of room, 1.5 of it (past the predictor's 0.5) for talker slots at 0.25: 5 (6 with the scratch)
    assert plan.num_slots == {"thinker": 7, "talker": 5, "code2wav": 0}
    only_own = plan_memory(stages(thinker=0.2, talker=0.05), free_bytes=80 * GIB, total_bytes=100 * GIB,
                           fraction=None, device="cuda:0")
    assert only_own.num_slots == {"thinker": 7, "talker": 5, "code2wav": 0}  # 5 GiB: talker as above


def test_without_a_fraction_each_stage_gets_max_num_seqs_slots():
    plan = plan_memory(stages(), free_bytes=80 * GIB, total_bytes=100 * GIB, fraction=None, device="cpu")
    assert plan.num_slots == {"thinker": 4, "talker": 4, "code2wav": 0}
    assert plan.new_bytes == 5 * GIB + (5 * GIB // 4 + GIB // 2) + 7 * GIB


def test_slots_grow_only_where_they_pay_and_at_most_by_the_cap():
    no_reuse = plan_memory(stages(grow=False), 80 * GIB, 100 * GIB, 0.3, "cuda:0")
    assert no_reuse.num_slots == {"thinker": 4, "talker": 4, "code2wav": 0}
    roomy = plan_memory(stages(), 100 * GIB, 100 * GIB, 1.0, "cuda:0")
    assert roomy.num_slots["thinker"] == roomy.num_slots["talker"] == MAX_SLOTS_PER_SEQ * 4


def test_a_plan_that_cannot_fit_names_the_key_and_the_numbers():
    with pytest.raises(ProfileError) as err:
        plan_memory(stages(thinker=0.15), 80 * GIB, 100 * GIB, 0.3, "cuda:0")
    assert err.value.key == "stages[0].gpu_memory_utilization"
    assert str(err.value) == (
        "memory plan: stages[0].gpu_memory_utilization gives thinker 15.00 GiB of the 100.00 GiB on cuda:0: "
        "weights 10.00 GiB and graphs/workspace 2.00 GiB leave 3.00 GiB for the KV cache, but max_num_seqs x "
        "max_model_len needs 5.00 GiB (thinker 4 x 1024 tokens 5.00 GiB); raise stages[0].gpu_memory_utilization "
        "or lower max_num_seqs or max_model_len")
    with pytest.raises(ProfileError, match=r"^memory plan: gpu_memory_utilization gives thinker \+ talker \+ "
                                           r"code2wav 25.00 GiB .* leave 5.00 GiB .* needs 6.75 GiB"):
        plan_memory(stages(), 80 * GIB, 100 * GIB, 0.25, "cuda:0")


def test_a_plan_must_fit_the_memory_free_after_the_weights():
    with pytest.raises(ProfileError) as err:  # another process holds most of the device
        plan_memory(stages(), 10 * GIB, 100 * GIB, 0.3, "cuda:0")
    assert err.value.key == "gpu_memory_utilization"
    assert "the plan needs 16.25 GiB beyond the weights (KV 9.25 GiB, graphs/workspace 7.00 GiB) but cuda:0 has " \
           "10.00 GiB free of 100.00 GiB; lower gpu_memory_utilization or free the device" in str(err.value)
    with pytest.raises(ProfileError) as err:  # fixed sizing: the biggest cache's max_num_seqs is named
        plan_memory(stages(), 10 * GIB, 100 * GIB, None, "cpu")
    assert err.value.key == "stages[0].max_num_seqs" and "lower max_num_seqs or max_model_len" in str(err.value)


# ---- the tiny model on the CPU ---------------------------------------------------------------------------------


@pytest.fixture
def host(monkeypatch):
    """Fake the host's (available, total) memory, which the CPU platform's plan is sized from."""
    def install(free: int, total: int) -> None:
        monkeypatch.setattr("omnirt.pipeline.platform.host_memory", lambda: (free, total))
    return install


def _small(cfg, **top):
    """The tiny profile with 2 requests per stage, so that growth is visible in a few slots."""
    return dataclasses.replace(cfg, stages=tuple(dataclasses.replace(s, max_num_seqs=2) for s in cfg.stages), **top)


def test_the_tiny_model_is_sized_by_the_plan(tiny_config, host):
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    host(8 * GIB, 16 * GIB)
    models = load_models(_small(tiny_config, gpu_memory_utilization=0.5), get_platform("cpu"))
    plan, th, tk = models.plan, models.thinker, models.talker
    assert plan.num_slots["thinker"] == th.kv.num_slots == plan.num_slots["talker"] == tk.kv.num_slots == 8
    assert th.cuda_graphs.batch_sizes[-1] == tk.decode_graphs.batch_sizes[-1] == 2  # for the batch, not the slots
    assert tk.predictor_kv.num_slots == 2  # the code predictor's cache holds one batch
    rows = 2 * th.config.thinker_config.text_config.hidden_size * th.kv.max_len * 4  # resident prompt rows
    assert plan.kv_bytes("thinker") == th.kv.num_bytes + 9 * rows
    assert plan.kv_bytes("talker") == tk.kv.num_bytes + tk.predictor_kv.num_bytes + tk.past_hidden.numel() * 4
    weights = sum(p.numel() * p.element_size() for p in models.hf.thinker.parameters())
    assert next(s for s in plan.stages if s.name == "thinker").weight_bytes >= weights


def test_a_fraction_too_small_stops_the_start_naming_the_key(host):
    from omnirt.pipeline.serving.core import build_engine

    host(8 * GIB, 16 * GIB)
    with pytest.raises(EngineStartError, match=r"memory plan: gpu_memory_utilization gives thinker \+ talker \+ "
                                               r"code2wav 16.0 MiB of the 16.00 GiB on cpu: weights .* needs "):
        build_engine(EngineOptions(gpu_memory_utilization=2**-10, threads=1))


async def _turns(engine, num_conversations: int) -> list[tuple[int, int]]:
    """Each conversation's first turn, then each one's second: (first turn's prompt tokens, second turn's cached
    prompt tokens) per conversation."""
    async def ask(rid: str, messages: list[dict]) -> Finished:
        req = OmniRequest(rid, messages, ("text",), thinker_sampling={"max_tokens": 4})
        return [ev async for ev in await engine.submit(req) if isinstance(ev, Finished)][0]

    history, first = {}, {}
    for i in range(num_conversations):
        history[i] = [{"role": "user", "content": f"Conversation {i}: " + "tell me more " * (4 + i)}]
        first[i] = (await ask(f"c{i}-1", history[i])).usage.prompt_tokens
    out = []
    for i in range(num_conversations):
        turn = [*history[i], {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
        out.append((first[i], (await ask(f"c{i}-2", turn)).usage.cached_tokens))
    return out


@pytest.mark.parametrize("fraction,num_hits", [(None, 0), (0.5, 4)])
def test_grown_slots_keep_more_conversations_resident(tiny_config, host, fraction, num_hits):
    """With 2 slots, 4 conversations evict each other's prefixes; with the slots the plan grows (8), each
    one's next turn starts from its first."""
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform

    torch.set_num_threads(1)
    host(8 * GIB, 16 * GIB)
    cfg = _small(tiny_config, gpu_memory_utilization=fraction)
    engine = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    engine.start()
    try:
        cached = asyncio.run(_turns(engine, 4))
    finally:
        engine.stop()
    # a hit reuses the conversation's whole first prompt, not only the instructions all conversations share
    assert sum(reused >= prompt for prompt, reused in cached) == num_hits, cached
    assert engine.stage("thinker").scheduler.max_num_seqs == 2  # never more running than configured


# ---- the shipped GPU profiles against an H200 -------------------------------------------------------------------

H200_BYTES = 143771 * 2**20  # the total torch.cuda.mem_get_info reports on an H200
RUNTIME_BYTES = 2**30  # the CUDA context and what else a process holds before its plan


@pytest.fixture(scope="module")
def released_on_meta():
    """The released architecture with no memory behind it: its weights are counted from the shapes."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnirt.pipeline.models.qwen3_omni.released import released_config
    from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model
    from omnirt.pipeline.models.qwen3_omni.weights import _tokenizer

    with torch.device("meta"):
        return Qwen3OmniMoeForConditionalGeneration._from_config(released_config(_tokenizer(ensure_tiny_model())),
                                                                  dtype=torch.bfloat16)


@pytest.mark.parametrize("profile,processes", [
    ("qwen3_omni_moe.yaml", [("thinker", "talker", "code2wav")]),
    ("qwen3_omni_moe_1gpu.yaml", [("thinker", "talker", "code2wav")]),
    ("qwen3_omni_moe_multi_replicas.yaml", [("thinker",), ("talker",), ("code2wav",)]),
    ("qwen3_omni_moe_ray.yaml", [("thinker",), ("talker",), ("code2wav",)]),
])
def test_the_shipped_gpu_profiles_fit_an_h200(released_on_meta, profile, processes):
    from omnirt.pipeline.models.qwen3_omni.memory import stage_memory
    from omnirt.pipeline.profile import DEPLOY_DIR
    from tests.profiles import load_profile

    cfg = load_profile(DEPLOY_DIR / profile, "cuda")
    for stages in processes:  # each process plans the stages it loads, on a device of its own
        needs = [dataclasses.replace(s, weight_bytes=2 * sum(p.numel() for p in getattr(released_on_meta, s.name)
                                                              .parameters()))
                 for s in stage_memory(released_on_meta, cfg, stages, graphs=True)]
        weights = sum(s.weight_bytes for s in needs)
        plan = plan_memory(needs, H200_BYTES - weights - RUNTIME_BYTES, H200_BYTES, cfg.gpu_memory_utilization,
                           "cuda:0")
        assert all(plan.num_slots[s.name] >= s.max_num_seqs for s in needs if s.slot_bytes)
        assert plan.headroom_bytes > 0
    if profile == "qwen3_omni_moe_1gpu.yaml":  # the header's figures, measured on an H200 with fixed sizing
        thinker = next(s for s in needs if s.name == "thinker")
        assert round(65 * (thinker.slot_bytes - 2 * 2048 * 2048 * 2) / GIB, 1) == 12.2
        assert round(weights / GIB, 1) == 65.7
