"""Unit tests of the engine's building blocks: slot cache, scheduler, sampler, codec chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnirt.pipeline.models.qwen3_omni.codec_stream import CodecStream
from omnirt.pipeline.stage.kv_cache import SlotKVCache
from omnirt.pipeline.stage.request import RequestStatus, StageRequest
from omnirt.pipeline.stage.sampling import Sampler, SamplingParams
from omnirt.pipeline.stage.scheduler import SlotScheduler
from omnirt.pipeline.stage.step import RowOutput


def _kv(slots=4, max_len=64):
    return SlotKVCache(1, slots, 1, max_len, 2, torch.float32, "cpu")


def test_cache_view_writes_in_place_and_masks():
    kv = _kv()
    a, b = kv.allocate(), kv.allocate()
    view = kv.view([a, b], [0, 5], [3, 1])  # row 0 prefills 3, row 1 decodes at position 5
    k = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    view.select_layer(0)
    keys, _ = view.update(k, k.clone(), 0)
    assert keys.shape == (2, 1, 6, 2)
    assert torch.equal(kv.k[0, a, 0, :3], k[0, 0])
    assert torch.equal(kv.k[0, b, 0, 5], k[1, 0, 0]) and not kv.k[0, b, 0, 6].any()  # padding not written
    mask = view.mask[:, 0]
    assert mask[0, 2, :3].all() and not mask[0, 0, 1:].any()  # causal inside the prefill
    assert mask[1, 0, :6].all()  # the decode row sees its whole history
    kv.free(a)
    assert kv.num_free_slots == 3


def _req(rid, n_prompt, max_tokens=3):
    return StageRequest(rid, SamplingParams(temperature=0, max_tokens=max_tokens), num_prompt_tokens=n_prompt)


def test_scheduler_chunked_prefill_alternates_with_decode():
    kv = _kv()
    s = SlotScheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, eos_ids=[99], is_ready=lambda r: True)
    short, long_ = _req("a", 4), _req("b", 20)
    s.add(short)
    batch = s.schedule()
    assert batch.is_prefill and batch.num_new_tokens == [4]
    s.launched(batch)
    s.update(batch, [RowOutput(token=1)])
    s.add(long_)
    kinds = []
    for _ in range(6):
        batch = s.schedule()
        kinds.append(("P" if batch.is_prefill else "D", tuple(batch.num_new_tokens)))
        token = None if batch.is_prefill else 1
        s.launched(batch)
        s.update(batch, [RowOutput(token=token) for _ in batch.requests])
    # the long prompt is chunked to the token budget and never stalls the decoder two steps in a row
    assert kinds[:4] == [("D", (1,)), ("P", (8,)), ("D", (1,)), ("P", (8,))]
    assert short.status is RequestStatus.FINISHED_LENGTH and short.slot is None
    assert kinds[4] == ("P", (4,)) and long_.num_computed_tokens == 21  # prompt done, then one decode


def test_scheduler_respects_slots_and_eos():
    kv = _kv(slots=2)
    s = SlotScheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, eos_ids=[7], is_ready=lambda r: True)
    reqs = [_req(str(i), 2, max_tokens=10) for i in range(3)]
    for r in reqs:
        s.add(r)
    batch = s.schedule()
    assert len(batch.requests) == 2 and len(s.waiting) == 1  # only two slots
    s.launched(batch)
    finished = s.update(batch, [RowOutput(token=7), RowOutput(token=3)])
    assert finished == [reqs[0]] and reqs[0].status is RequestStatus.FINISHED_STOPPED
    s.schedule()
    assert reqs[2] in s.running and reqs[2].slot is not None and reqs[0].slot is None
    assert not s.waiting  # the freed slot admitted the waiting request


def test_sampler_greedy_penalty_suppress_min_tokens():
    sampler = Sampler(5, eos_ids=[4], suppress_ids=[0])
    logits = torch.tensor([[9.0, 1.0, 2.0, 3.0, 8.0]])
    greedy = SamplingParams(temperature=0)
    assert sampler(logits.clone(), [greedy], [[]], [None]).tolist() == [4]  # 0 suppressed
    assert sampler(logits.clone(), [greedy.merged(min_tokens=2)], [[1]], [None]).tolist() == [3]  # no EOS yet
    assert sampler(logits.clone(), [greedy.merged(repetition_penalty=3.0)], [[4]], [None]).tolist() == [3]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    draws1 = [int(sampler(logits.clone(), [p], [[]], [g1])[0]) for _ in range(20)]
    draws2 = [int(sampler(logits.clone(), [p], [[]], [g2])[0]) for _ in range(20)]
    assert draws1 == draws2 and set(draws1) <= {3, 4}  # seeded, and within top-k/top-p


def test_seen_tokens_per_slot_equal_the_whole_history_mask():
    """The device mask kept per slot, fed only each step's new tokens, equals the mask built from the whole
    histories at every step; a new request in a slot (another history) starts from nothing."""
    from omnirt.pipeline.stage.pinned import PinnedBuffers
    from omnirt.pipeline.stage.sampling import SeenTokens, _seen_mask

    rng = np.random.default_rng(0)
    pinned, seen = PinnedBuffers(torch.device("cpu")), SeenTokens(50, torch.device("cpu"))
    short = _seen_mask(torch.zeros(2, 50), [[0, 7, 9], [0]], pinned.tensor)  # row 1 padded: its token 0 stays
    assert short.nonzero().tolist() == [[0, 0], [0, 7], [0, 9], [1, 0]]
    histories = {slot: [] for slot in (0, 3, 5)}
    for step in range(30):
        if step in (9, 20):
            histories[3] = [int(rng.integers(50))] if step == 20 else []  # slot 3 taken over by a new request
        slots = [s for s in histories if rng.random() < 0.8] or [0]
        hists = [histories[s] for s in slots]
        assert torch.equal(seen.mask(slots, hists, pinned),
                           _seen_mask(torch.zeros(len(slots), 50), hists, pinned.tensor))
        for s in slots:
            histories[s].append(int(rng.integers(50)))


def test_sampler_penalty_with_slots_matches_without():
    """Penalised sampling through the per-slot mask picks what the whole-history path picks."""
    torch.manual_seed(1)
    with_slots, without = Sampler(40, eos_ids=[]), Sampler(40, eos_ids=[])
    p = [SamplingParams(temperature=0, repetition_penalty=1.7)] * 2
    hists: list[list[int]] = [[], []]
    for _ in range(25):
        logits = torch.randn(2, 40)
        a = with_slots(logits.clone(), p, hists, [None, None], [4, 1]).tolist()
        assert a == without(logits.clone(), p, hists, [None, None]).tolist()
        for h, t in zip(hists, a):
            h.append(t)
def test_repetition_penalty_in_a_batch_is_each_rows_own():
    """Rows with histories of different lengths (a batch of requests at different steps) are penalised as
    transformers' processor penalises each alone, token 0 included, with and without per-slot masks."""
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 8)
    histories = [[0, 5], [1, 2, 3, 4, 6, 7], [3]]
    params = [SamplingParams(temperature=0, repetition_penalty=r) for r in (1.5, 1.2, 2.0)]
    for slots in (None, [2, 0, 5]):
        got = Sampler(8, eos_ids=[]).process(logits.clone(), params, histories, slots=slots)
        for row, (h, p) in enumerate(zip(histories, params)):
            penalty = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
            assert torch.equal(got[row], penalty(torch.tensor([h]), logits[row:row + 1].clone())[0]), (slots, row)


def test_graph_safe_sampling_draws_from_the_same_distribution_as_the_warpers():
    """The code predictor's top-k/top-p (top-p over the sorted top-k values) keeps exactly the tokens that
    transformers' order keeps (`warp`), and draws them in proportion."""
    from omnirt.pipeline.stage.sampling import sample_top_k_top_p, warp

    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    draws = sample_top_k_top_p(logits.repeat(5000, 1), torch.zeros(20000, dtype=torch.bool), 50, 0.8).view(5000, 4)
    put = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype)  # noqa: E731
    expected = warp(logits, [SamplingParams(temperature=1.0, top_k=50, top_p=0.8)] * 4, put).softmax(-1)
    for row in range(4):
        seen = torch.bincount(draws[:, row], minlength=300) / 5000
        assert not seen[expected[row] == 0].any()  # nothing outside the kept set (2 to 9 tokens here)
        assert (seen[expected[row] > 0.005] > 0).all()
        assert 0.5 * (seen - expected[row]).abs().sum() < 0.03  # total variation: sampling noise only
    greedy = sample_top_k_top_p(logits, torch.ones(4, dtype=torch.bool), 50, 0.8)
    assert torch.equal(greedy, logits.argmax(-1))


def test_codec_stream_schedule():
    s = CodecStream.fixed(initial_frames=2, chunk_frames=5, left_context_frames=3, ramp=False)
    s.frames = [[i] * 16 for i in range(13)]
    sizes = []
    while s.is_ready():
        window, n = s.next_window()
        sizes.append((n, window.num_context, window.is_first))
        s.advance(n)
    assert sizes == [(2, 0, True), (5, 2, False), (5, 3, False)]
    s.input_done = True
    window, n = s.next_window()
    assert n == 1 and window.num_context == 3 and s.is_ready()


def test_codec_stream_ramp_doubles_up_to_the_chunk_size():
    s = CodecStream.fixed(initial_frames=2, chunk_frames=12, left_context_frames=3, ramp=True)
    s.frames = [[0] * 16] * 40
    sizes = []
    while s.is_ready():
        n = s.next_window()[1]
        sizes.append(n)
        s.advance(n)
    assert sizes == [2, 4, 8, 12, 12]


def test_incremental_detokenizer_matches_a_full_decode_and_never_splits_a_character():
    """Token by token, the deltas join to the full decode, and no delta carries U+FFFD for a multi-byte
    character whose bytes span several tokens; each call decodes a window, not the whole reply."""
    from transformers import AutoTokenizer

    from omnirt.pipeline.engine.detokenizer import IncrementalDetokenizer
    from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(), local_files_only=True)
    text = "Grüße aus Köln — 你好，世界! 🎉🎉 naïve café " * 3
    ids = tok(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters do span tokens
    calls = []
    decode = tok.decode
    tok.decode = lambda window, **kw: calls.append(len(window)) or decode(window, **kw)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert max(calls) < 16  # a short window per step, never the whole reply (len(ids) is far more)
    assert len(ids) > 60


def test_a_dummy_build_of_billions_of_weights_on_a_cpu_is_announced(caplog):
    """`--load-format dummy` of the released 30B model on a CPU fills 35 B random weights, which takes minutes:
    a warning says so before it starts. The tiny model, or a GPU, builds without one."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnirt.pipeline.models.qwen3_omni import released
    from omnirt.pipeline.models.qwen3_omni.tiny import ensure_tiny_model
    from omnirt.pipeline.models.qwen3_omni.weights import PARTS, _tokenizer, warn_if_slow

    tokenizer = _tokenizer(ensure_tiny_model())
    with torch.device("meta"):
        big = Qwen3OmniMoeForConditionalGeneration._from_config(released.released_config(tokenizer))
        tiny = Qwen3OmniMoeForConditionalGeneration._from_config(
            type(big.config).from_pretrained(ensure_tiny_model()))
    cpu, all_parts, name = torch.device("cpu"), frozenset(PARTS), "omnirt.pipeline.models.qwen3_omni.weights"
    caplog.clear()
    with caplog.at_level("WARNING", logger=name):
        warn_if_slow(tiny, all_parts, torch.float32, cpu)
        warn_if_slow(big, all_parts, torch.bfloat16, torch.device("cuda", 0))
        assert not [r for r in caplog.records if r.name == name]
        warn_if_slow(big, all_parts, torch.bfloat16, cpu)
    (said,) = [r.getMessage() for r in caplog.records if r.name == name]
    assert "35.3 B parameters" in said and "66 GiB" in said and "minutes" in said and "--model tiny" in said


def test_dummy_weights_are_the_same_on_every_start():
    """`--load-format dummy` builds seeded random weights: two starts compare on the same model, and the
    caller's random stream is left as it was."""
    from omnirt.pipeline.models.qwen3_omni.weights import PARTS, load_hf_model

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    a, *_ = load_hf_model("tiny", "dummy", torch.float32, torch.device("cpu"), "eager", frozenset(PARTS))
    after = torch.rand(3)
    b, *_ = load_hf_model("tiny", "dummy", torch.float32, torch.device("cpu"), "eager", frozenset(PARTS))
    assert torch.equal(after, expected)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and streams need a CUDA device")
def test_the_host_tier_round_trips_a_slot_through_pinned_memory_in_stream_order():
    """On a stream of its own, as a stage runs: a resident slot given up is copied to pinned host memory, the slot is
    overwritten at once, and the prefix copied back equals what it held, with no synchronisation between the copies
    (they are ordered on the stream)."""
    from omnirt.pipeline.stage.kv_cache import SlotKVCache

    class Held:
        num_tokens = num_prompt_tokens = 48
        num_bytes = 0

        def to(self, device):
            return self

    kv = SlotKVCache(2, 1, 2, 64, 8, torch.bfloat16, "cuda", host_bytes=2**20)
    with torch.cuda.stream(torch.cuda.Stream()):
        kv.k[:, 0].copy_(torch.randn_like(kv.k[:, 0]))
        kv.v[:, 0].copy_(torch.randn_like(kv.v[:, 0]))
        k, v = kv.k[:, 0, :, :48].clone(), kv.v[:, 0, :, :48].clone()
        kv.park(0, Held())
        assert kv.allocate() == 0  # the only slot: its prefix goes to the host first
        (entry,) = kv.host.entries
        kv.k[:, 0].fill_(-1.0)
        kv.v[:, 0].fill_(-1.0)
        kv.restore(entry, 0, 48)
        torch.cuda.current_stream().synchronize()
    assert entry.k.is_pinned() and entry.v.is_pinned()
    assert torch.equal(kv.k[:, 0, :, :48], k) and torch.equal(kv.v[:, 0, :, :48], v)
    assert bool((kv.k[:, 0, :, 48:] == -1).all())
