"""Prefix reuse over the slot KV cache: each turn of a conversation pays only for what is new.

When a request ends, its slot is parked *resident* (`SlotKVCache.park`) with what it holds instead of
being freed: the keys of the positions whose KV was written. A new request whose prompt begins with
those keys gets the slot and starts its prefill after them (`num_computed_tokens`), so nothing is
recomputed. It takes the slot over when it matches at least the ended request's prompt (it is that
conversation's next turn); when it matches less (another conversation with the same instructions, the
same history with another last message), the matched positions are copied into another slot (a free
one, else the least recently used resident one), so that the rest stays for whoever continues it.
Resident slots count as free: the least recently used one is given up whenever a slot is needed, so
reuse never costs capacity, and a request that finds nothing (or whose slot was given up) is
prefilled in full as without reuse.

What a key is, and what else a slot holds for the request that takes it over, is the stage model's
business (`PrefixReuse`); the scheduler only asks it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from omnirt.pipeline.stage.request import StageRequest


class Held(Protocol):
    """What a resident slot holds, as its model describes it."""

    @property
    def num_tokens(self) -> int:
        """Positions [0, num_tokens) whose KV the slot holds."""

    @property
    def num_prompt_tokens(self) -> int:
        """Of those, the ended request's prompt; past them lies its own reply, which only the next turn of
        its conversation would continue."""

    @property
    def num_bytes(self) -> int:
        """Memory it keeps beyond the slot's KV (rows for another stage, say)."""

    def to(self, device: torch.device) -> Held:
        """The same, its tensors on `device` (the host tier keeps it on the host: `host_tier.py`)."""


class PrefixReuse(Protocol):
    """A stage model's rules for reusing resident slots."""

    def key(self, req: StageRequest) -> Any:
        """What `req`'s prompt is, for `match` (None: nothing to reuse for it)."""

    def match(self, held: Held, key: Any) -> int:
        """How many leading positions of the prompt `key` have their KV in the slot that holds `held` (at most
        the prompt's length: a slot that holds all of it ends the scheduler's search)."""

    def held(self, req: StageRequest) -> Held | None:
        """What `req`'s slot holds now that it ended (None: nothing reusable; the slot is freed)."""

    def adopt(self, req: StageRequest, held: Held, num_tokens: int) -> None:
        """`req` starts with the first `num_tokens` positions of a slot that holds `held`."""


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two 1-d arrays of one dtype."""
    return common_prefix_bytes(a.tobytes(), b.tobytes(), a.itemsize)


def common_prefix_bytes(a: bytes, b: bytes, itemsize: int) -> int:
    """The same over the arrays' bytes, in items of `itemsize` bytes. A scheduler compares a new prompt with
    every resident slot's: byte-string comparisons (memcmp) in a binary search, no array built per call."""
    n = min(len(a), len(b)) // itemsize
    if a[:n * itemsize] == b[:n * itemsize]:
        return n
    same, differ = 0, n  # the first `same` items agree; the first `differ` do not
    while differ - same > 1:
        mid = (same + differ) // 2
        if a[:mid * itemsize] == b[:mid * itemsize]:
            same = mid
        else:
            differ = mid
    return same
