"""Prefix reuse (`omnirt/pipeline/stage/prefix_cache.py`): each turn of a conversation prefills only what is new, and
answers exactly as a full prefill would; resident slots give way under pressure; aborts and failures
leave nothing wrong behind."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from omnirt.pipeline.api import OmniRequest, TextDelta, collect_reply
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.prefix_cache import common_prefix
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.sampling import SamplingParams
from omnirt.pipeline.stage.scheduler import SlotScheduler
from omnirt.pipeline.stage.step import RowOutput
from tests.test_parity import engine_generate, started_engine
from tests.test_truncation import Driver, turn_text

# ---- the scheduler and the slot cache, with keys that are plain token ids -------------------------------


@dataclasses.dataclass
class Held:
    key: np.ndarray
    num_prompt_tokens: int
    num_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    def to(self, device):
        return self


class IdsReuse:
    """A slot holds the ids it computed (prompt, then fed outputs); `req.state` is the prompt's ids."""

    def key(self, req):
        return req.state

    def match(self, held, key):
        return common_prefix(held.key, key)

    def held(self, req):
        written = np.concatenate([req.state, np.asarray(req.output_ids, dtype=np.int64)])[:req.num_computed_tokens]
        return Held(written, min(len(written), req.num_prompt_tokens))

    def adopt(self, req, held, n):
        pass


def _setup(slots: int = 3, max_len: int = 64, host_bytes: int = 0):
    kv = SlotKVCache(1, slots, 1, max_len, 2, torch.float32, "cpu", host_bytes=host_bytes)
    return kv, SlotScheduler(kv, max_num_seqs=slots, max_num_batched_tokens=8, eos_ids=[99], is_ready=lambda r: True,
                             reuse=IdsReuse())


def _req(rid: str, ids: list[int], max_tokens: int = 2) -> StageRequest:
    return StageRequest(rid, SamplingParams(temperature=0, max_tokens=max_tokens), np.asarray(ids, dtype=np.int64),
                        num_prompt_tokens=len(ids))


def _run(s: SlotScheduler, req: StageRequest, token: int = 5) -> None:
    """Add `req` and step until it ends (every step samples `token`)."""
    s.add(req)
    while not req.status.is_finished:
        batch = s.schedule()
        outs = [RowOutput(token=token if n + r.num_computed_tokens >= r.num_prompt_tokens else None)
                for r, n in zip(batch.requests, batch.num_new_tokens)]
        s.launched(batch)
        s.update(batch, outs)


def test_a_prompt_that_extends_a_resident_slot_takes_it_over_and_prefills_the_rest():
    kv, s = _setup()
    first = _req("a", list(range(10, 22)))  # 12 prompt tokens, 2 sampled: the last one is never fed
    _run(s, first)
    assert first.slot is None and kv.num_free_slots == kv.num_slots and len(kv.resident) == 1
    (slot, held), = kv.resident.items()
    assert held.key.tolist() == list(range(10, 22)) + [5]
    same = _req("s", list(range(10, 22)))  # all of it matches: its last token is still computed (its logits)
    s.add(same)
    s.schedule()
    assert same.num_computed_tokens == 11 and same.slot != slot and slot in kv.resident  # copied (a little short)
    s.finish(same, RequestStatus.FINISHED_ABORTED)
    second = _req("b", list(range(10, 22)) + [5, 5, 7])
    s.add(second)
    batch = s.schedule()
    assert second.slot == slot and slot not in kv.resident  # a's next turn: taken over
    assert second.num_cached_tokens == second.num_computed_tokens == 13 and batch.num_new_tokens == [2]
    assert s.take_cached() == [("s", 11), ("b", 13)] and s.num_cached_tokens == 24 and s.take_cached() == []


def test_the_next_turn_takes_the_slot_over_even_where_the_reply_it_resends_differs():
    kv, s = _setup(slots=2)
    _run(s, _req("a", [1, 2, 3, 4]))  # holds [1, 2, 3, 4, 5]
    (slot, _), = kv.resident.items()
    nxt = _req("b", [1, 2, 3, 4, 6, 6])  # the reply cut short (barge-in) or re-tokenized otherwise
    s.add(nxt)
    s.schedule()
    assert nxt.slot == slot and not kv.resident and nxt.num_computed_tokens == 4


def test_the_search_stops_at_a_slot_that_holds_the_whole_prompt():
    """Residents are searched most recently used first; one holding all of the new prompt cannot be beaten, so
    the older ones are not compared (a scheduler compares every new prompt with every resident slot)."""
    kv, s = _setup(slots=4)
    calls = []
    s.reuse.match = lambda held, key: calls.append(held) or common_prefix(held.key, key)
    _run(s, _req("old", list(range(30, 42))))
    _run(s, _req("recent", list(range(10, 22))))
    calls.clear()
    again = _req("again", list(range(10, 22)))
    s.add(again)
    s.schedule()
    assert again.num_computed_tokens == 11 and len(calls) == 1 and calls[0].key[0] == 10


def test_a_partial_match_copies_into_another_slot_and_keeps_the_resident_one():
    kv, s = _setup(slots=2)
    _run(s, _req("a", [1, 2, 3, 4, 5, 6]))
    (src, _), = kv.resident.items()
    kv.k[0, src, 0, :7] = torch.arange(7, dtype=torch.float32)[:, None]
    other = _req("b", [1, 2, 3, 9, 9])
    s.add(other)
    s.schedule()
    assert other.slot != src and other.num_computed_tokens == 3 and src in kv.resident  # copied, not taken
    assert torch.equal(kv.k[0, other.slot, 0, :3], kv.k[0, src, 0, :3])
    copy = other.slot
    s.finish(other, RequestStatus.FINISHED_ABORTED)  # parked too, holding [1, 2, 3]
    third = _req("c", [1, 2, 3, 4, 8])  # a part of a's again, and no slot is free: the least recently used
    s.add(third)                         # resident one but a's (b's) is given up for the copy
    s.schedule()
    assert third.slot == copy and list(kv.resident) == [src] and third.num_computed_tokens == 4


def test_resident_slots_give_way_to_new_requests_least_recently_used_first():
    kv, s = _setup(slots=2)
    _run(s, _req("a", [1, 1, 1]))
    _run(s, _req("b", [2, 2, 2]))
    assert len(kv.resident) == 2 and kv.num_free_slots == 2
    slot_a = next(iter(kv.resident))
    c = _req("c", [3, 3, 3])
    s.add(c)
    s.schedule()
    assert c.slot == slot_a and c.num_cached_tokens == 0 and [h.key[0] for h in kv.resident.values()] == [2]


def test_an_abort_during_a_step_parks_what_was_issued_up_to_it_and_a_failure_parks_nothing():
    """A step's KV writes are on the stream before anything a later step reads, so a slot parked while the
    step runs (an abort that lands meanwhile) holds the positions it was issued for; not those never issued."""
    kv, s = _setup()
    req = _req("a", list(range(20)))  # prefill chunks of 8
    s.add(req)
    batch = s.schedule()
    s.launched(batch)
    s.update(batch, [RowOutput()])
    batch = s.schedule()  # the second chunk is issued; the abort lands before its results are applied
    s.launched(batch)
    s.finish(req, RequestStatus.FINISHED_ABORTED)
    s.update(batch, [RowOutput()])
    assert [h.key.tolist() for h in kv.resident.values()] == [list(range(16))]
    failed = _req("b", list(range(16)) + [50])
    s.add(failed)
    s.schedule()
    assert failed.num_cached_tokens == 16
    s.finish(failed, RequestStatus.FINISHED_ERROR)
    assert not kv.resident and kv.num_free_slots == kv.num_slots


def _mark(kv: SlotKVCache, slot: int, base: float) -> torch.Tensor:
    """Distinct K and V values in every position of `slot`; returns its K."""
    kv.k[:, slot] = base + torch.arange(kv.k[:, slot].numel(), dtype=torch.float32).view_as(kv.k[:, slot])
    kv.v[:, slot] = -kv.k[:, slot]
    return kv.k[:, slot].clone()


def test_a_given_up_slot_goes_to_the_host_tier_and_its_next_turn_gets_it_back():
    """With a host tier a resident slot given up for another request keeps its prefix on the host; the
    conversation's next turn has it copied back into a slot (the KV exactly) and prefills only what is new."""
    kv, s = _setup(slots=1, host_bytes=2**20)
    _run(s, _req("a", [1, 2, 3, 4, 5, 6]))  # holds [1..6, 5]
    k_a = _mark(kv, 0, 100.0)
    _run(s, _req("b", [7, 7, 7]))  # the one slot: a's prefix goes to the host
    assert [e.held.key.tolist() for e in kv.host.entries] == [[1, 2, 3, 4, 5, 6, 5]]
    _mark(kv, 0, 900.0)
    nxt = _req("a2", [1, 2, 3, 4, 5, 6, 5, 8])
    s.add(nxt)
    batch = s.schedule()
    assert nxt.slot == 0 and nxt.num_cached_tokens == 7 and batch.num_new_tokens == [1]
    assert torch.equal(kv.k[:, 0, :, :7], k_a[:, :, :7]) and torch.equal(kv.v[:, 0, :, :7], -k_a[:, :, :7])
    assert [e.held.key.tolist() for e in kv.host.entries] == [[7, 7, 7, 5]]  # b's, given up for a2; a's taken
    stats = s.prefix_stats()
    assert (stats.num_cached_tokens, stats.num_restored_tokens, stats.num_offloaded) == (7, 7, 1)
    assert stats.num_offloaded_bytes == 2 * 4 * 2 * 4  # K and V, 4 positions of 2 floats


def test_a_partial_match_in_the_host_tier_is_copied_and_stays_there():
    kv, s = _setup(slots=1, host_bytes=2**20)
    _run(s, _req("a", [1, 2, 3, 4, 5, 6]))
    _run(s, _req("b", [7, 7, 7]))
    other = _req("c", [1, 2, 3, 9])  # another conversation with a's start: it copies, a's whole prefix stays
    s.add(other)
    s.schedule()
    assert other.num_cached_tokens == 3
    assert sorted(e.held.key[0] for e in kv.host.entries) == [1, 7]


def test_the_host_tier_gives_up_its_least_recently_used_prefixes_past_its_bytes():
    entry_bytes = 2 * 4 * 2 * 4  # K and V of a prompt of 3 with its fed token: 4 positions of 2 floats
    kv, s = _setup(slots=1, host_bytes=2 * entry_bytes)
    for i in range(4):
        _run(s, _req(f"r{i}", [10 + i] * 3))
    assert [e.held.key[0] for e in kv.host.entries] == [11, 12] and kv.host.num_bytes == 2 * entry_bytes
    kv, s = _setup(slots=1, host_bytes=entry_bytes - 1)  # smaller than one prefix: nothing is kept
    for i in range(2):
        _run(s, _req(f"r{i}", [10 + i] * 3))
    assert not kv.host.entries and kv.host.num_bytes == 0


# ---- the engine: a conversation with and without reuse ----------------------------------------------------

def _with(cfg, reuse: bool, offload_gib: float = 0.0):
    """The tiny profile with a 1024-token Thinker of 2 slots (a few long turns overflow it; three
    conversations do not fit), prefix reuse on or off, a host tier of `offload_gib` behind the slots."""
    stages = [dataclasses.replace(s, prefix_caching=reuse, kv_offload_gib=offload_gib if s.stage_id < 2 else 0.0)
              for s in cfg.stages]
    stages[0] = dataclasses.replace(stages[0], max_model_len=1024, max_num_seqs=2)
    return dataclasses.replace(cfg, stages=tuple(stages))


@pytest.fixture(scope="module")
def engines(tiny_config):
    """(reuse on, reuse off)."""
    with started_engine(_with(tiny_config, True)) as on, started_engine(_with(tiny_config, False)) as off:
        yield on, off


def _audio(seconds: float, seed: int) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * (200 + 90 * seed) * t) + 0.02 * np.random.default_rng(seed).standard_normal(
        t.size)).astype(np.float32)


USER_TURNS = [
    {"role": "user", "content": turn_text(0, 40)},
    {"role": "user", "content": [{"type": "audio", "audio": _audio(1.0, 1)}, {"type": "text", "text": "And this?"}]},
    {"role": "user", "content": turn_text(2, 40)},
    {"role": "user", "content": [{"type": "audio", "audio": _audio(1.6, 3)}]},  # longer than the audio before it
    {"role": "user", "content": turn_text(4, 40)},
    {"role": "user", "content": "Short one."},
    {"role": "user", "content": [{"type": "audio", "audio": _audio(0.7, 6)}, {"type": "text", "text": "Last."}]},
]


def _last_kv(engine) -> dict[str, torch.Tensor]:
    """Per stage, the KV of the slot the last request left: resident (with reuse, the positions it holds) or
    freed (without, its prompt and the fed reply)."""
    out = {}
    for stage in ("thinker", "talker"):
        kv = engine.stage(stage).scheduler.kv
        if kv.resident and engine.stage(stage).scheduler.reuse is not None:
            slot, held = next(reversed(kv.resident.items()))
            out[stage] = kv.k[:, slot, :, :held.num_tokens].clone()
        else:
            out[stage] = kv.k[:, kv._free[-1]].clone()  # the slot freed last (the free list is a queue)
    return out


async def _conversation(engine, tag: str) -> list[tuple]:
    """The user turns, each answered in text and audio; a truncated turn's cut stays for the turns after it
    (as a Realtime session keeps it). Per turn: (tokens, codec frames, PCM, Finished, KV per stage)."""
    messages, out = [{"role": "system", "content": "Be brief."}], []
    for i, user in enumerate(USER_TURNS):
        messages.append(user)
        tokens, frames, pcm, fin = await engine_generate(engine, f"{tag}-{i}", list(messages), truncation=0.5)
        out.append((tokens, frames, pcm, fin, _last_kv(engine)))
        if fin.truncated_messages:
            messages = messages[:1] + messages[1 + fin.truncated_messages:]
        # the reply as it re-tokenizes to its own tokens where it can (the tiny model's are mostly special
        # ones, kept here), so that the next prompt runs into the reply's positions in the slot
        messages.append({"role": "assistant", "content": engine.models.tokenizer.decode(tokens)})
    return out


def _prefill_counts(engine) -> dict[str, tuple[int, int]]:
    return {s.name: s.scheduler.prefix_stats()[:2] for s in engine.stages[:2]}


async def test_a_conversation_answers_the_same_with_and_without_reuse(engines):
    on, off = engines
    before = _prefill_counts(on), _prefill_counts(off)
    with_reuse, without = await _conversation(on, "reuse"), await _conversation(off, "full")
    after = _prefill_counts(on), _prefill_counts(off)
    with _talker_reuse_off(on):  # the Talker prefills in full, from the Thinker rows resident slots kept
        thinker_only = await _conversation(on, "thinker-reuse")
    for i, (a, b, c) in enumerate(zip(with_reuse, without, thinker_only)):
        assert a[0] == b[0] == c[0] and a[1] == b[1] == c[1] and len(a[1]) > 4, i  # all 16 codebooks per frame
        assert np.array_equal(a[2], b[2]) and np.array_equal(c[2], b[2]), i
        assert (a[3].usage.prompt_tokens, a[3].truncated_messages) == (b[3].usage.prompt_tokens,
                                                                       b[3].truncated_messages)
        for stage, kv in a[4].items():  # what a slot holds for reuse is what a full prefill writes
            n = kv.shape[2]
            assert n > 0 and torch.allclose(kv, b[4][stage][:, :, :n], atol=1e-4), (i, stage)
    assert all(b[3].usage.cached_tokens == 0 for b in without)
    usage = [a[3].usage for a in with_reuse]
    cut = [i for i, a in enumerate(with_reuse) if a[3].truncated_messages]
    assert cut and cut[0] > 1, usage
    assert usage[0].cached_tokens == 0
    for i in range(1, len(usage)):  # the whole previous prompt is reused, but across a cut (instructions only)
        if i in cut:
            assert 0 < usage[i].cached_tokens < usage[i - 1].prompt_tokens, (i, usage)
        else:
            assert usage[i - 1].prompt_tokens <= usage[i].cached_tokens < usage[i].prompt_tokens, (i, usage)
    for stage in ("thinker", "talker"):  # reuse computes only what full prefill does not get from the slots
        (computed_on, cached_on), (computed_off, cached_off) = (
            [x - y for x, y in zip(a[stage], b[stage])] for a, b in zip(after, before))
        assert cached_off == 0 and cached_on > 0 and computed_on + cached_on == computed_off, stage


@contextlib.contextmanager
def _talker_reuse_off(engine):
    sched = engine.stage("talker").scheduler
    saved, sched.reuse = sched.reuse, None
    try:
        yield
    finally:
        sched.reuse = saved


async def _text_turns(engine, tag: str, order: list[tuple[int, str]]) -> list[tuple[list[int], object]]:
    """Text-only conversations, turns taken in `order` ((conversation, user text)); per turn (tokens, usage)."""
    histories: dict[int, list[dict]] = {}
    out = []
    for n, (conv, text) in enumerate(order):
        messages = histories.setdefault(conv, [{"role": "system", "content": "You are terse."}])
        messages.append({"role": "user", "content": text})
        req = OmniRequest(f"{tag}-{n}", list(messages), thinker_sampling={"temperature": 0.0, "max_tokens": 6})
        reply = await collect_reply(await engine.submit(req))
        messages.append({"role": "assistant", "content": reply.text})
        out.append((reply.token_ids, reply.finished.usage))
    return out


async def test_resident_slots_are_evicted_under_pressure_and_answers_stay_the_same(engines):
    on, off = engines  # two Thinker slots for three conversations
    topics = ("dragons", "castles", "rivers")
    order = [(c, f"{topics[c]}: conversation {c}, turn {t}") for t in range(2) for c in range(3)]
    order += [(0, "one more"), (0, "and the last")]
    with_reuse, without = await _text_turns(on, "evict", order), await _text_turns(off, "evict-full", order)
    assert [t for t, _ in with_reuse] == [t for t, _ in without]
    encode = on.models.encoder.encode
    shared = common_prefix(*(np.frombuffer(encode([{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": order[c][1]}]).cache_key, np.int64)
                             for c in (0, 1)))
    cached = [u.cached_tokens for _, u in with_reuse]
    # the round robin outgrows the slots, least recently used first: every turn until conversation 0 goes
    # on alone finds its own conversation given up (the instructions match, from another one's slot)...
    assert all(0 < n <= shared for n in cached[1:7]), (shared, cached)
    # ...then its last turn finds the one before resident again, and reuses all of it
    assert cached[7] >= with_reuse[6][1].prompt_tokens, cached
    assert len(on.stage("thinker").scheduler.kv.resident) <= 2 and on.num_free_slots() == on.num_slots()
    placements = on.stage("thinker").scheduler.placements
    assert placements["taken_over"] >= 1 and placements["restored"] == 0, placements  # conversation 0's last turn


async def test_with_a_host_tier_every_turn_reuses_its_whole_conversation_and_answers_the_same(engines,
                                                                                               tiny_config):
    """The same round robin with a host tier behind the two slots: a given-up conversation's prefix comes back
    from the host, so every later turn reuses all of its conversation so far, and the answers are those of full
    prefills."""
    _, off = engines
    topics = ("dragons", "castles", "rivers")
    order = [(c, f"{topics[c]}: conversation {c}, turn {t}") for t in range(3) for c in range(3)]
    with started_engine(_with(tiny_config, True, offload_gib=0.05)) as tiered:
        with_tier, without = await _text_turns(tiered, "tier", order), await _text_turns(off, "tier-full", order)
        stats = tiered.stage("thinker").scheduler.prefix_stats()
        host = tiered.stage("thinker").scheduler.kv.host
    assert [t for t, _ in with_tier] == [t for t, _ in without]
    usage = [u for _, u in with_tier]
    for n in range(3, len(order)):  # the turn three before is this conversation's last one
        assert usage[n - 3].prompt_tokens <= usage[n].cached_tokens < usage[n].prompt_tokens, (n, usage)
    assert stats.num_restored_tokens == sum(u.cached_tokens for u in usage[3:])  # each from the host tier
    assert stats.num_offloaded == len(host.entries) > 0 and stats.num_offloaded_bytes == host.num_bytes
    # how each turn got its slot: the first fresh, the next two copying the instructions from another
    # conversation's slot, every later one restored; each after the first two gave a resident slot up
    assert stats.placements == {"fresh": 1, "taken_over": 0, "copied": 2, "restored": 6}, stats.placements
    assert stats.num_given_up == len(order) - 2, stats.num_given_up


async def test_an_aborted_reply_leaves_a_prefix_the_next_turn_reuses_exactly(engines):
    on, off = engines
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a long story."}]
    first = on.models.encoder.encode(messages)
    events = await on.submit(OmniRequest("abort-mid", list(messages), thinker_sampling={
        "temperature": 0.0, "max_tokens": 60, "min_tokens": 60}))
    text = ""
    async for ev in events:
        if isinstance(ev, TextDelta):
            text += ev.text
            break  # the prompt is in, the reply under way
    await events.aclose()  # the engine aborts it mid-reply
    for _ in range(200):  # until the Thinker let it go (a liveness wait, not a latency bound)
        if not on.stage("thinker").requests:
            break
        await asyncio.sleep(0.02)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    results = []
    for engine in (on, off):
        reply = await collect_reply(await engine.submit(OmniRequest(
            f"after-abort-{id(engine)}", list(messages), thinker_sampling={"temperature": 0.0, "max_tokens": 8})))
        results.append(reply)
    assert results[0].token_ids == results[1].token_ids
    assert results[0].finished.usage.cached_tokens >= len(first.input_ids)


async def test_realtime_usage_counts_the_history_each_response_reused(engine):
    d = Driver(engine)
    await d.start("auto")
    usage = [(await d.turn(i))["usage"] for i in range(3)]
    await d.close()
    # each response reuses the one before's prompt, but for its assistant header (3 tokens) when the reply was
    # empty (the tiny model's two tokens are often special ones): the session then leaves the item out
    for before, now in zip(usage, usage[1:]):
        assert before["input_tokens"] - 3 <= now["input_token_details"]["cached_tokens"] < now["input_tokens"], usage


def test_set_turns_prefix_reuse_off_in_every_stage_that_has_it():
    """`--set 'stages.*.prefix_caching=false'` (the old `--no-prefix-caching`) reaches every autoregressive stage
    and leaves Code2Wav, which has no KV cache, alone; other stage keys stay."""
    from omnirt.pipeline.api import EngineOptions
    from tests.profiles import engine_config

    opts = EngineOptions(settings=("stages.*.prefix_caching=false",), stage_overrides={"1": {"max_num_seqs": 2}})
    cfg = engine_config(opts, "cpu")
    assert [s.prefix_caching for s in cfg.stages[:2]] == [False, False] and cfg.stage("talker").max_num_seqs == 2
    assert all(s.prefix_caching for s in engine_config(EngineOptions(), "cpu").stages)


def test_common_prefix_over_bytes_is_the_first_differing_item():
    """The binary search over byte strings finds the first item where two arrays differ (not a byte: an item
    may differ in its high bytes alone), at every position and for every length."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 40, 64, dtype=np.int64)
    for n in (0, 1, 2, 17, 64):
        for at in range(n + 1):
            other = base[:n].copy()
            if at < n:
                other[at] += 1 << 33  # differs in its high bytes only
            want = at if at < n else n
            assert common_prefix(base[:n], other) == want
            assert common_prefix(base, other) == want  # the shorter one bounds it
            assert common_prefix(other, base[:n + 3]) == want
