"""Per-request sampling, batched on the device, in the order transformers' logits processors apply it.

Repetition penalty, min-tokens, suppression and a grammar's token mask first, then temperature, top-k and
top-p; greedy
(temperature 0 or top_k 1) is a plain argmax so that it matches the reference `generate()`. The
whole batch is one set of tensor ops and one device->host copy (per-request settings go the other
way through pinned memory); only seeded rows draw with their own generator, so a seed reproduces
whatever batch the request lands in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from omnirt.pipeline.stage.grammar import apply_token_bitmask
from omnirt.pipeline.stage.pinned import PinnedBuffers

Put = Callable[..., torch.Tensor]  # (values, dtype) -> a device tensor


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    seed: int | None = None
    # teacher forcing (the parity check's): step k emits forced[k] instead of sampling, or for a stage whose step
    # makes a frame of codes, forced[k] is that frame (its first code is the token; the model forces the rest)
    forced: tuple = ()

    def __post_init__(self):
        assert self.temperature >= 0, "temperature must be >= 0"
        assert self.top_k >= -1, "top_k must be >= 0 (or -1 for off)"
        assert 0 < self.top_p <= 1, "top_p must be in (0, 1]"
        assert self.repetition_penalty > 0, "repetition_penalty must be > 0"
        assert self.max_tokens >= 1, "max_tokens must be >= 1"
        assert 0 <= self.min_tokens, "min_tokens must be >= 0"

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def merged(self, **overrides) -> SamplingParams:
        """These params with the non-None overrides applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


class SamplingError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def numerically_safe(params: SamplingParams) -> SamplingParams:
    """Refuse values that would overflow inside a step (and so fail it): float fields as finite floats,
    integer fields as integers, the seed in torch.Generator's range; temperatures below 1e-5 are greedy, as in vLLM."""
    try:
        floats = {k: float(getattr(params, k)) for k in ("temperature", "top_p", "repetition_penalty")}
    except (OverflowError, TypeError, ValueError) as exc:
        raise SamplingError(f"bad sampling parameters: {exc}", "sampling") from exc
    if not all(map(math.isfinite, floats.values())) or not 1e-5 <= floats["repetition_penalty"] <= 1e5:
        raise SamplingError("temperature, top_p and repetition_penalty must be finite; repetition_penalty "
                           "in [1e-5, 1e5]", "sampling")
    for name in ("top_k", "max_tokens", "min_tokens", "seed"):
        value = getattr(params, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SamplingError(f"{name} must be an integer, got {value!r}", name)
    if params.seed is not None and not -(2**63) <= params.seed < 2**64:
        raise SamplingError(f"seed must be in [-2**63, 2**64), got {params.seed}", "seed")
    if 0 < floats["temperature"] < 1e-5:
        floats["temperature"] = 0.0
    return params.merged(**floats)


class Sampler:
    """Samples one token per row; `suppress_ids` are never produced, `eos_ids` not before min_tokens."""

    def __init__(self, vocab_size: int, eos_ids: list[int], suppress_ids: list[int] | None = None):
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.suppress_ids = suppress_ids or []
        self._suppress: dict[torch.device, torch.Tensor] = {}
        self._eos: dict[torch.device, torch.Tensor] = {}
        self._staging: PinnedBuffers | None = None  # the calling stage's thread only
        self._seen: SeenTokens | None = None

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                 generators: list[torch.Generator | None], slots: list[int] | None = None,
                 bitmask: torch.Tensor | None = None, pending: list[int] | None = None) -> torch.Tensor:
        """One token per row, on the device (the stage's runner brings them to the host). With `slots` (each row's KV
        slot) the repetition penalty reads a per-slot mask of seen tokens kept on the device, which also takes
        each sampled token on the device: a row's `pending` tokens (sampled in a step still in flight, async
        scheduling) are in it though not yet in its history. `bitmask` [rows, vocab/32] int32, on the host:
        each row's allowed tokens (`omnirt/pipeline/stage/grammar.py`; all bits set for a free row)."""
        put = self._put(logits.device)
        counts = [len(h) + (pending[i] if pending else 0) for i, h in enumerate(histories)]
        logits = self.process(logits.float(), params, histories, put, slots, bitmask, counts)
        tokens = logits.argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            rows = put(sampled)
            warped = warp(logits[rows], [params[i] for i in sampled], put)
            tokens[rows] = draw(warped, [generators[i] for i in sampled])
        if forced := [(i, p.forced[n]) for i, (p, n) in enumerate(zip(params, counts)) if n < len(p.forced)]:
            firsts = [f if isinstance(f, int) else f[0] for _, f in forced]  # a frame's first code is the token
            at, values = self._staging_for(logits.device).tensors([i for i, _ in forced], firsts)
            tokens[at] = values
        if slots is not None and self._seen is not None:
            self._seen.add(tokens)
        return tokens

    def _put(self, device: torch.device) -> Put:
        return self._staging_for(device).tensor

    def _staging_for(self, device: torch.device) -> PinnedBuffers:
        if self._staging is None or self._staging.device != device:
            self._staging = PinnedBuffers(device)
        return self._staging

    def process(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                put: Put | None = None, slots: list[int] | None = None, bitmask: torch.Tensor | None = None,
                counts: list[int] | None = None):
        """Penalty, min-tokens, suppression and the grammar's mask: the processors that also apply to greedy
        decoding. A constrained row ends when its grammar allows it: min-tokens does not hold its end back.
        `counts`: each row's tokens so far (its history's length unless some are still in flight)."""
        device = logits.device
        put = put or self._put(device)
        counts = counts or [len(h) for h in histories]
        penalties = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in penalties) and (slots is not None or any(histories)):
            if slots is None:
                seen = _seen_mask(logits, histories, put)
            else:
                self._seen = self._seen or SeenTokens(self.vocab_size, device)
                seen = self._seen.mask(slots, histories, self._staging_for(device))
            pen = put(penalties, torch.float32)[:, None]
            logits = torch.where(seen, torch.where(logits < 0, logits * pen, logits / pen), logits)
        free = [True] * len(params) if bitmask is None else (bitmask != -1).any(-1).logical_not().tolist()
        early = [n < p.min_tokens and f for p, n, f in zip(params, counts, free)]
        if any(early) and self.eos_ids:  # a fill by masks: indexed stores of a Python scalar copy it from the host
            held = put(early, torch.bool)[:, None] & self._mask(self._eos, self.eos_ids, device)
            logits = logits.masked_fill(held, float("-inf"))
        if self.suppress_ids:
            logits = logits.masked_fill(self._mask(self._suppress, self.suppress_ids, device), float("-inf"))
        if bitmask is not None:
            logits = apply_token_bitmask(logits, self._staging_for(device).copy(bitmask))
        return logits

    def _mask(self, cache: dict[torch.device, torch.Tensor], ids: list[int], device: torch.device) -> torch.Tensor:
        """[vocab] bool, True at `ids`, on `device` (made once)."""
        if device not in cache:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[ids] = True
            cache[device] = mask.to(device)
        return cache[device]


def _seen_mask(logits: torch.Tensor, histories: list[list[int]], put: Put) -> torch.Tensor:
    """[B, vocab]: the tokens each row's history holds, built from the whole histories. Padding goes to an
    extra column (padding a row at token 0 raced its real token 0 in the scatter)."""
    width, vocab = max(len(h) for h in histories) or 1, logits.shape[-1]
    hist = put([t for h in histories for t in h + [vocab] * (width - len(h))]).view(len(histories), width)
    seen = torch.zeros(len(histories), vocab + 1, dtype=torch.bool, device=logits.device)
    return seen.scatter_(1, hist, True)[:, :vocab]


class SeenTokens:
    """Per KV slot, the tokens its request has produced, as a [slots, vocab] mask on the device, updated
    with only each step's new tokens: copying whole histories cost the host O(reply length) per row per
    step (a c=64 Talker step near the end of long replies staged ~64 k ids). A slot's row is cleared when
    a different request (another history list) samples in it, or its history got shorter. Each sampled token is
    also set at once on the device (`add`), so a token still on its way to the history counts in the next step."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.rows = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._owner: dict[int, tuple[list[int], int]] = {}  # slot -> (the history it holds, tokens counted)
        self._last_rows: torch.Tensor | None = None  # the slots of the last `mask` call, for `add`

    def mask(self, slots: list[int], histories: list[list[int]], pinned: PinnedBuffers) -> torch.Tensor:
        """[B, vocab]: row i holds the tokens of row i's slot, once this step's new tokens are added."""
        if max(slots) >= len(self.rows):
            grown = torch.zeros(max(slots) + 1, self.vocab_size, dtype=torch.bool, device=self.device)
            grown[:len(self.rows)] = self.rows
            self.rows = grown
        cleared, new_slots, new_tokens = [], [], []
        for slot, hist in zip(slots, histories):
            owner, counted = self._owner.get(slot, (None, 0))
            if owner is not hist or counted > len(hist):
                cleared.append(slot)
                counted = 0
            new_slots.extend([slot] * (len(hist) - counted))
            new_tokens.extend(hist[counted:])
            self._owner[slot] = (hist, len(hist))
        rows, cleared_rows, new_rows, new_ids = pinned.tensors(slots, cleared, new_slots, new_tokens)
        # index_fill_ takes its value as a kernel argument: `rows[i] = False` would copy a host scalar and make
        # the thread wait for the device, every step (which undoes async scheduling)
        if cleared:
            self.rows.index_fill_(0, cleared_rows, False)
        if new_tokens:
            self.rows.view(-1).index_fill_(0, new_rows * self.vocab_size + new_ids, True)
        self._last_rows = rows
        return self.rows[rows]

    def add(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the slots of the last `mask` call, set on the device (their histories
        get them later; setting a token twice changes nothing)."""
        if self._last_rows is not None:
            self.rows.view(-1).index_fill_(0, self._last_rows * self.vocab_size + tokens, True)
            self._last_rows = None


def warp(logits: torch.Tensor, params: list[SamplingParams], put: Put) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' order), per row."""
    logits = logits / put([p.temperature for p in params], torch.float32)[:, None]
    ks = [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params]
    if min(ks) < logits.shape[-1]:
        top = torch.topk(logits, max(ks), dim=-1).values
        kth = top.gather(1, put(ks)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_p = put([p.top_p for p in params], torch.float32)[:, None]
        sorted_logits, order = torch.sort(logits, descending=False)
        remove = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        remove[:, -1] = False
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample each row: an exponential race over the probabilities (no host sync); seeded rows use
    their own CPU generator so the draw does not depend on the batch."""
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i] = torch.empty(probs.shape[-1]).exponential_(generator=gen).to(probs.device)
    return (probs / noise).argmax(-1)


def sample_top_k_top_p(logits: torch.Tensor, greedy: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Graph-safe sampling with fixed settings (no host data): argmax where `greedy`, else temperature 1,
    top-k, top-p and an exponential race on the device's default generator. Top-p runs on the k values
    `topk` returns already sorted: the same tokens as transformers' warpers (which sort the whole
    vocabulary), without the sort. A token is kept while the mass before it is below top_p."""
    values, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
    probs = values.softmax(-1)
    keep = probs.cumsum(-1) - probs < top_p  # the first is always kept
    choice = (probs * keep / torch.empty_like(probs).exponential_()).argmax(-1, keepdim=True)
    return torch.where(greedy, logits.argmax(-1), ids.gather(1, choice)[:, 0])
