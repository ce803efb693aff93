"""Async scheduling (`omnirt/pipeline/stage/loop.py`): the Talker issues step n+1 before step n's codes reach the host.
The replies must be the ones the synchronous loop gives, token for token, whatever ends them; counted in steps."""

from __future__ import annotations

import asyncio

import torch

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.sampling import SamplingParams
from omnirt.pipeline.stage.scheduler import SlotScheduler
from omnirt.pipeline.stage.step import Finish, RowOutput
from tests.conftest import ROOT

PROMPTS = ["Tell me a story about a dragon.", "Hello there, how are you?", "Numbers 1 2 3 4 5",
           "A brave knight and a castle", "Quick brown fox jumps", "What is the weather like?"]


async def _reply(engine, req: OmniRequest):
    return await collect_reply(await engine.submit(req))


async def _replies(ahead: bool, talker_sampling: dict, max_frames: int = 40):
    """Six concurrent replies on the tiny engine; with what the Talker stage reported, in order (its outputs and
    its finishes, per request)."""
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform
    from tests.profiles import load_profile

    cfg = load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu", {}, {"1": {"async_scheduling": ahead}})
    models = load_models(cfg, get_platform("cpu"))
    with torch.inference_mode():  # as on CUDA, where the model's pinned buffers are made in inference mode:
        models.talker.last_codes = models.talker.last_codes.clone()  # the runner must write them in it too
    engine = OmniEngine(cfg, models)
    talker, reported = engine.stage("talker"), {}
    route = talker.on_step

    def record(stage: str, result):
        for out in result.outputs:
            reported.setdefault(out.request_id, []).append(out.token)
        for fin in result.finished:
            reported.setdefault(fin.request_id, []).append(fin)
        route(stage, result)

    talker.on_step = record
    engine.start()
    try:
        reqs = [OmniRequest(f"r{i}", [{"role": "user", "content": t}], ("text", "audio"),
                            thinker_sampling={"max_tokens": 8 + i},
                            talker_sampling={"max_tokens": max_frames + 3 * i, **talker_sampling})
                for i, t in enumerate(PROMPTS)]
        replies = await asyncio.gather(*(_reply(engine, r) for r in reqs))
        outcomes = [(r.text, r.pcm16, r.finished.usage.audio_frames) for r in replies]
        return outcomes, talker.counters.num_steps_ahead, reported
    finally:
        engine.stop()


async def test_greedy_replies_are_the_same_with_the_talker_scheduling_ahead_and_not():
    sampling = {"temperature": 0.0, "repetition_penalty": 1.3, "min_tokens": 6}
    on, ahead, _ = await _replies(True, sampling)
    off, not_ahead, _ = await _replies(False, sampling)
    assert ahead > 0 and not_ahead == 0  # the loop did issue steps before the last one landed
    for (text_on, pcm_on, frames_on), (text_off, pcm_off, frames_off) in zip(on, off):
        assert text_on == text_off and frames_on == frames_off > 0
        assert len(pcm_on) == len(pcm_off)
        diff = max(abs(a - b) for a, b in zip(memoryview(pcm_on).cast("h"), memoryview(pcm_off).cast("h")))
        assert diff <= 2  # int16 steps: batched float math may differ in the last bits


async def test_a_reply_that_the_codec_eos_ends_gets_no_frame_of_the_step_issued_after_it():
    """Sampled codes (the code predictor draws from the device's generator, so replies depend on the batches
    and are compared by invariants, not with a synchronous run): each request's Talker outputs end with its
    finish, an EOS-ended one with EOS, and it handed Code2Wav one frame per decode step before its end."""
    # replies of up to 100 codes: at 40, 2 to 4 of the 6 ended by EOS in runs here; at 100 the chance that
    # none does is far below 1 in 10 000
    replies, ahead, reported = await _replies(True, {"temperature": 1.0, "top_k": 0, "repetition_penalty": 1.05},
                                              max_frames=100)
    assert ahead > 0
    eos = 0
    for i, (_, _, frames) in enumerate(replies):
        *tokens, fin = reported[f"r{i}"]
        assert isinstance(fin, Finish) and fin.num_output_tokens == len(tokens) >= 1
        assert frames == len(tokens) - 1  # the prefill's token starts the first frame; no frame after the last
        if fin.status is RequestStatus.FINISHED_STOPPED:
            eos += 1
            assert len(tokens) <= 100 + 3 * i and tokens.count(tokens[-1]) == 1  # EOS, once, at the end
    assert eos > 0  # some replies did end by EOS, with steps of theirs in flight


def _req(rid: str, max_tokens: int) -> StageRequest:
    return StageRequest(rid, SamplingParams(temperature=0, max_tokens=max_tokens), num_prompt_tokens=2)


def test_a_request_steps_again_with_a_token_in_flight_unless_that_token_ends_it():
    kv = SlotKVCache(1, 4, 1, 64, 2, torch.float32, "cpu")
    s = SlotScheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, eos_ids=[9], is_ready=lambda r: True)
    a, b = _req("a", max_tokens=10), _req("b", max_tokens=2)
    s.add(a)
    s.add(b)
    prefill = s.schedule()
    s.launched(prefill)
    assert a.num_pending == b.num_pending == 1 and a.num_outputs == 1
    step1 = s.schedule()  # issued before the prefill's tokens land
    assert step1.requests == [a, b] and not step1.is_prefill
    s.launched(step1)
    assert s.schedule() is None  # a has a token in flight already; b's second token is its last (max_tokens)
    s.update(prefill, [RowOutput(token=9), RowOutput(token=3)])  # a's first token is EOS
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_ids == [9] and a.slot is None
    assert s.update(step1, [RowOutput(token=4), RowOutput(token=5)]) == [b]  # a's void step is skipped
    assert a.output_ids == [9] and b.output_ids == [3, 5] and b.status is RequestStatus.FINISHED_LENGTH
