"""Prefixes the slot KV cache gave up, kept in host memory: a second tier behind the resident slots.

A conversing session speaks for a tenth of its turn or so; between its turns its resident slot waits for the next
one. With more sessions than slots, the least recently used resident slot is given up to a new request
(`SlotKVCache.allocate`), and the next turn of that conversation would prefill its whole history again (its earlier
turns' audio encoded again too). With a host tier the slot's KV prefix is copied to host memory first (an async copy
on the device's stream, into pinned memory where the device is an accelerator), and a later prompt that starts with
it has it copied back into a slot: ~0.1 GB for a 1,000-token Thinker conversation, a few milliseconds over PCIe,
where the prefill would take a step of its own. Least recently used entries go first once `max_bytes` is reached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, eq=False)
class Offloaded:
    """One given-up slot's prefix: its KV [layers, kv_heads, n, head_dim] and what the slot held (`Held`), on the
    host."""

    k: torch.Tensor
    v: torch.Tensor
    held: Any

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + self.held.num_bytes


class HostTier:
    """Offloaded prefixes, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Offloaded, None] = OrderedDict()
        self.num_bytes = 0

    def add(self, entry: Offloaded) -> None:
        """Keep `entry` as the most recently used, giving up the least recently used ones as needed (one larger
        than the tier is not kept)."""
        if entry.num_bytes > self.max_bytes:
            return
        while self.num_bytes + entry.num_bytes > self.max_bytes:
            self.num_bytes -= self.entries.popitem(last=False)[0].num_bytes
        self.entries[entry] = None
        self.num_bytes += entry.num_bytes

    def take(self, entry: Offloaded) -> None:
        """Out of the tier (a request takes its prefix over)."""
        del self.entries[entry]
        self.num_bytes -= entry.num_bytes
