"""Per-request sampling, in the order transformers' logits processors apply it.

Repetition penalty, min-tokens and suppression first, then temperature, top-k and top-p; greedy
(temperature 0 or top_k 1) is a plain argmax so that it matches the reference `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 0
    seed: int | None = None

    def __post_init__(self):
        assert self.temperature >= 0, "temperature must be >= 0"
        assert self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (or -1 for off)"
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


class Sampler:
    """Samples one token per row; `suppress_ids` are never produced, `eos_ids` not before min_tokens."""

    def __init__(self, vocab_size: int, eos_ids: list[int], suppress_ids: list[int] | None = None):
        self.eos_ids = eos_ids
        self.suppress = torch.zeros(vocab_size, dtype=torch.bool)
        if suppress_ids:
            self.suppress[suppress_ids] = True
        self.has_suppress = bool(suppress_ids)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
                 generators: list[torch.Generator | None]) -> list[int]:
        logits = logits.float()
        if self.has_suppress:
            logits = logits.masked_fill(self.suppress.to(logits.device), float("-inf"))
        tokens = []
        for row, p, hist, gen in zip(logits, params, histories, generators, strict=True):
            tokens.append(self._sample_row(row, p, hist, gen))
        return tokens

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, hist: list[int],
                    gen: torch.Generator | None) -> int:
        if p.repetition_penalty != 1.0 and hist:
            idx = torch.tensor(sorted(set(hist)), device=row.device)
            score = row[idx]
            row[idx] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
        if len(hist) < p.min_tokens:
            row[self.eos_ids] = float("-inf")
        if p.is_greedy:
            return int(row.argmax())
        row = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=False)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            remove = cum <= 1 - p.top_p
            remove[-1] = False
            row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
        probs = row.softmax(-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))
