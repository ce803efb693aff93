"""First packet first (`omnirt/pipeline/stage/priority.py`): which runnable requests take a step's rows, at the
scheduler and through the engine. Everything is counted in steps, never in time."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from omnirt.pipeline.api import OmniRequest, collect_reply
from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from omnirt.pipeline.models.qwen3_omni.pacing import FixedChunks
from omnirt.pipeline.stage.chunk_scheduler import ChunkScheduler
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.priority import Priority
from omnirt.pipeline.stage.request import StageRequest
from omnirt.pipeline.stage.sampling import SamplingParams
from omnirt.pipeline.stage.scheduler import SlotScheduler
from omnirt.pipeline.stage.step import RowOutput
from tests.conftest import ROOT


def _scheduler(slots: int, max_num_seqs: int, priority: Priority | None, budget: int = 64) -> SlotScheduler:
    kv = SlotKVCache(1, slots, 1, 512, 2, torch.float32, "cpu")
    return SlotScheduler(kv, max_num_seqs, budget, eos_ids=[99], is_ready=lambda r: True, priority=priority)


def _req(rid: str, num_prompt: int = 2, max_tokens: int = 50, first: int = 1) -> StageRequest:
    return StageRequest(rid, SamplingParams(temperature=0, max_tokens=max_tokens), num_prompt_tokens=num_prompt,
                        num_first_packet_outputs=first)


def _step(s: SlotScheduler):
    """One step with token 1 for every row that finishes its prompt; returns the batch (None: nothing ran)."""
    batch = s.schedule()
    if batch is not None:
        done = [r.num_computed_tokens + n >= r.num_prompt_tokens for r, n in zip(batch.requests, batch.num_new_tokens)]
        s.launched(batch)
        s.update(batch, [RowOutput(token=1 if d else None) for d in done])
    return batch


def _running_past_first_packet(s: SlotScheduler, n: int) -> list[StageRequest]:
    reqs = [_req(f"old{i}") for i in range(n)]
    for r in reqs:
        s.add(r)
    _step(s)  # their prompts; each has its first output
    assert all(not r.is_owed_first_packet for r in reqs)
    return reqs


def test_a_request_owed_its_first_packet_takes_a_full_steps_row_before_a_running_one():
    s = _scheduler(slots=4, max_num_seqs=2, priority=Priority(max_wait_steps=4))
    a, b = _running_past_first_packet(s, 2)
    new = _req("new", first=3)
    s.add(new)
    assert _step(s).requests == [a, b]  # decode (the step after a prefill); `new` got a slot beyond the 2 rows
    assert new.slot is not None and s.num_running == 3
    assert _step(s).requests == [new]  # its prompt (a prefill step)
    decodes = [_step(s).requests for _ in range(2)]
    # while owed its first packet (3 outputs) it is in every full step; a and b take the other row in turns
    assert decodes == [[a, new], [b, new]]
    assert not new.is_owed_first_packet and s.waits.num_deferred == 2
    assert [r.request_id for r in _step(s).requests] == ["old0", "old1"]  # now a and b, most waited first


def test_a_background_request_owes_no_first_packet():
    """A transcript of the user (`OmniRequest.background`) ranks with the running requests, after new replies."""
    from omnirt.pipeline.models.qwen3_omni.graph import new_requests
    from omnirt.pipeline.models.qwen3_omni.prompt import EncodedPrompt

    params = {"thinker": SamplingParams(temperature=0, max_tokens=8)}
    for background, owed in ((False, True), (True, False)):
        req = OmniRequest("r", [{"role": "user", "content": "hi"}], background=background)
        thinker = new_requests(None, None, req, EncodedPrompt([1, 2, 3]), None, params)["thinker"]
        assert thinker.is_owed_first_packet is owed


def test_without_the_priority_a_new_request_waits_for_a_slot_and_steps_keep_arrival_order():
    s = _scheduler(slots=4, max_num_seqs=2, priority=None)
    a, b = _running_past_first_packet(s, 2)
    new = _req("new", first=3)
    s.add(new)
    for _ in range(5):
        assert _step(s).requests == [a, b]
    assert new.slot is None and list(s.waiting) == [new] and s.waits.num_deferred == 0
    assert new.num_waited_steps == 5  # counted for /metrics all the same


@pytest.mark.parametrize("priority", [Priority(), None], ids=["priority", "arrival"])
def test_a_long_prompt_prefills_in_bounded_chunks_between_the_decode_steps(priority):
    s = _scheduler(slots=4, max_num_seqs=4, priority=priority, budget=8)
    decoders = _running_past_first_packet(s, 2)
    long_ = _req("long", num_prompt=50)
    s.add(long_)
    kinds = []
    while long_.is_prefill:
        batch = _step(s)
        kinds.append(batch.is_prefill)
        if batch.is_prefill:
            assert sum(batch.num_new_tokens) <= 8
        else:
            assert batch.requests == decoders  # every decoder in every decode step
    assert kinds.count(True) == math.ceil(50 / 8)
    assert all(not (p and q) for p, q in zip(kinds, kinds[1:]))  # never two prefill steps in a row


def _run_stream(priority: Priority, num_steps: int, every: int = 1, slots: int = 12, rows: int = 3):
    """Four long replies, and every `every` steps a new short request (its reply is its first packet: 3 tokens).
    Returns the most consecutive steps a request holding a slot was left out of, and the steps each ran in."""
    s = _scheduler(slots=slots, max_num_seqs=rows, priority=priority)
    for i in range(4):
        s.add(_req(f"long{i}", max_tokens=10**6))
    worst, last, ran = 0, {}, {}
    for step in range(num_steps):
        if step % every == 0:
            s.add(_req(f"new{step}", max_tokens=3, first=3))
        batch = _step(s)
        for r in batch.requests:
            last[r.request_id] = step
            ran.setdefault(r.request_id, []).append(step)
        for r in s.running:  # every request holding a slot could run (is_ready is always true here)
            worst = max(worst, step - last.setdefault(r.request_id, step - 1))
    return worst, ran


@pytest.mark.parametrize("every", [1, 2], ids=["saturating", "every-other-step"])
@pytest.mark.parametrize("k, rows, slots", [(4, 3, 12), (1, 1, 4), (2, 4, 16), (6, 2, 8)])
def test_under_a_constant_stream_of_new_requests_every_running_request_advances_within_the_bound(every, k, rows,
                                                                                                 slots):
    worst, ran = _run_stream(Priority(max_wait_steps=k), 300, every, slots, rows)
    bound = k + 2 * math.ceil(slots / rows)  # the documented bound: decode steps come at least every other step
    assert worst <= bound
    for i in range(4):  # the long replies keep going to the end
        assert ran[f"long{i}"][-1] >= 300 - bound and len(ran[f"long{i}"]) >= 300 // bound


def test_without_aging_a_saturating_stream_starves_the_running_replies():
    """The bound above is aging's work: with an unreachable max_wait_steps the new requests take every row."""
    worst, _ = _run_stream(Priority(max_wait_steps=10**9), 300)
    assert worst > 100


def _codec_req(rid: str, num_frames: int, is_first: bool) -> StageRequest:
    """A stream with a window due: its first chunk of 2 frames (and last: the input is done), or a steady one."""
    st = CodecStream(2, FixedChunks(2, 4, num_chunks=0 if is_first else 1), frames=[[0] * 16] * num_frames,
                     num_emitted=0 if is_first else 2, input_done=is_first)
    return StageRequest(rid, SamplingParams(), st)


def _chunk_steps(s: ChunkScheduler, num_steps: int, new_per_step: int) -> list[list[str]]:
    batches = []
    for step in range(num_steps):
        for i in range(new_per_step):
            s.add(_codec_req(f"n{step}.{i}", 2, is_first=True))
        batch = s.schedule()
        s.update(batch, [RowOutput() for _ in batch.requests])
        batches.append([r.request_id for r in batch.requests])
    return batches


def test_code2wav_runs_due_first_chunks_first_in_a_step_of_their_own():
    s = ChunkScheduler(max_num_seqs=4, priority=Priority(max_wait_steps=4))
    steady = [_codec_req(f"s{i}", 100, is_first=False) for i in range(3)]
    news = [_codec_req(f"n{i}", 2, is_first=True) for i in range(2)]
    for r in steady + news:
        s.add(r)
    batch = s.schedule()
    assert batch.requests == news and [len(r.state.next_window()[0].codes) for r in news] == [2, 2]
    s.update(batch, [RowOutput() for _ in batch.requests])  # their only chunk: they are done here
    assert s.schedule().requests == steady  # windows of 2 context + 4 new frames, in the next step


def test_code2wav_ages_steady_chunks_under_a_stream_of_first_chunks():
    k = 2
    s = ChunkScheduler(max_num_seqs=2, priority=Priority(max_wait_steps=k))
    for i in range(3):
        s.add(_codec_req(f"s{i}", 200, is_first=False))
    batches = _chunk_steps(s, 30, new_per_step=1)  # first chunks alone would take a step each
    assert s.waits.max_wait_steps <= k + 2  # max_wait_steps + ceil(overdue windows / rows)
    assert all(sum(f"s{i}" in b for b in batches) >= 30 // (k + 2 + 1) for i in range(3))
    assert sum(f"n{step}.0" in b for step, b in enumerate(batches)) >= 10  # a third run the step they are due


def test_code2wav_without_the_priority_takes_windows_in_arrival_order():
    s = ChunkScheduler(max_num_seqs=2, priority=None)
    reqs = [_codec_req("s0", 100, False), _codec_req("s1", 100, False), _codec_req("n", 2, True)]
    for r in reqs:
        s.add(r)
    assert s.schedule().requests == reqs[:2]


# ---- through the engine --------------------------------------------------------------------------------------


PROMPTS = ["Tell me a story about a dragon.", "Hello there, how are you?", "Numbers 1 2 3 4 5",
           "A brave knight and a castle", "Quick brown fox jumps", "What is the weather like?"]


async def _reply(engine, req: OmniRequest):
    return await collect_reply(await engine.submit(req))


async def _replies(priority: bool):
    from omnirt.pipeline.engine.omni import OmniEngine
    from omnirt.pipeline.models import load_models
    from omnirt.pipeline.platform import get_platform
    from tests.profiles import load_profile

    # 2 rows per Thinker and Talker step and 1 Code2Wav window for 6 requests; the memory plan gives the AR
    # stages 8 slots each, which the priority fills
    cfg = load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", "cpu",
                       {"gpu_memory_utilization": 0.05, "first_packet_priority": priority},
                       {"0": {"max_num_seqs": 2}, "1": {"max_num_seqs": 2}, "2": {"max_num_seqs": 1}})
    engine = OmniEngine(cfg, load_models(cfg, get_platform("cpu")))
    engine.start()
    try:
        reqs = [OmniRequest(f"r{i}", [{"role": "user", "content": t}], ("text", "audio"),
                            thinker_sampling={"max_tokens": 8 + i}, talker_sampling={"max_tokens": 20 + 3 * i})
                for i, t in enumerate(PROMPTS)]
        replies = await asyncio.gather(*(_reply(engine, r) for r in reqs))
        waits = {s.name: s.scheduler.waits for s in engine.stages}
        firsts = {s.name: (sum(s.first_output_counts), s.first_output_s) for s in engine.stats().stages}
        return [(r.text, r.pcm16, r.finished.finish_reason) for r in replies], waits, firsts
    finally:
        engine.stop()


async def test_greedy_replies_are_the_same_with_the_priority_on_and_off():
    on, waits_on, firsts = await _replies(priority=True)
    off, waits_off, _ = await _replies(priority=False)
    for (text_on, pcm_on, fin_on), (text_off, pcm_off, fin_off) in zip(on, off):
        assert text_on == text_off and fin_on == fin_off
        assert len(pcm_on) == len(pcm_off) > 0
        diff = max(abs(a - b) for a, b in zip(memoryview(pcm_on).cast("h"), memoryview(pcm_off).cast("h")))
        assert diff <= 2  # int16 steps: batched float math may differ in the last bits
    # the priority did choose: the Thinker ran more requests than a step holds and left some out of steps,
    # which arrival order never does (at most max_num_seqs hold a slot)
    assert waits_on["thinker"].num_deferred > 0 and waits_off["thinker"].num_deferred == 0
    assert waits_on["thinker"].num_first_steps == waits_off["thinker"].num_first_steps == len(PROMPTS)
    # and placed at once, new requests waited fewer steps for their first step (in arrival order 4 of the 6
    # wait for whole replies of others: tens of steps)
    for stage in ("thinker", "talker"):
        assert waits_on[stage].first_wait_steps < waits_off[stage].first_wait_steps
    # each stage's first output for each request was timed (omnirt/pipeline/engine/timeline.py), and for each request
    # the Thinker's first token comes before the Talker's first frame, which comes before Code2Wav's first PCM
    assert [firsts[s][0] for s in ("thinker", "talker", "code2wav")] == [len(PROMPTS)] * 3
    assert 0 < firsts["thinker"][1] <= firsts["talker"][1] <= firsts["code2wav"][1]


def test_first_output_times_fall_in_prometheus_buckets():
    """A bucket holds the values up to and including its bound; one past the last bound holds the rest."""
    from omnirt.pipeline.api import FIRST_OUTPUT_BUCKETS_S
    from omnirt.pipeline.engine.timeline import FirstOutputTimes

    times = FirstOutputTimes()
    for seconds in (0.0, 0.025, 0.026, 10.0, 11.0):
        times.observe(seconds)
    counts, total = times.snapshot()
    assert counts[0] == 2 and counts[1] == 1 and counts[len(FIRST_OUTPUT_BUCKETS_S) - 1] == 1 and counts[-1] == 1
    assert sum(counts) == 5 and math.isclose(total, 21.051)
