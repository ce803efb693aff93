"""Preallocated slot-based KV cache.

Every request that holds a slot owns row `slot` of each layer's K/V buffer for its whole life, so
decode steps index fixed buffers by (slot, position) and never allocate per-request tensors. A
`CacheView` is the per-step object that transformers' attention layers call `update()` on: it
writes the new K/V rows in place and returns the keys/values the batch attends over.
"""

from __future__ import annotations

from collections import deque

import torch


class SlotKVCache:
    """K/V buffers of shape [layers, slots, kv_heads, max_len, head_dim], plus the free-slot list."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def allocate(self) -> int:
        return self._free.popleft()

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} freed twice"
        self._free.append(slot)

    def view(self, slots: list[int], starts: list[int], lengths: list[int]) -> CacheView:
        """A step over `lengths[i]` new tokens of row i, written from position `starts[i]` of its slot."""
        return CacheView(self, slots, starts, lengths)


class CacheView:
    """One step's window on the cache: where new K/V rows go and which keys each query may see."""

    def __init__(self, cache: SlotKVCache, slots: list[int], starts: list[int], lengths: list[int]):
        device = cache.k.device
        self.cache = cache
        self.num_new = max(lengths)
        self.kv_len = max(s + n for s, n in zip(starts, lengths, strict=True))
        assert self.kv_len <= cache.max_len, "sequence longer than the KV cache"
        self.slots = torch.tensor(slots, device=device)
        start = torch.tensor(starts, device=device)
        length = torch.tensor(lengths, device=device)
        offs = torch.arange(self.num_new, device=device)
        self.valid = offs[None, :] < length[:, None]  # [B, T]: padded query rows are not written
        query_pos = start[:, None] + offs[None, :]  # [B, T]
        self.write_slot = self.slots[:, None].expand_as(query_pos)[self.valid]
        self.write_pos = query_pos[self.valid]
        key_pos = torch.arange(self.kv_len, device=device)
        # causal within the new tokens, and never past a row's own end
        allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (
            key_pos[None, None, :] < (start + length)[:, None, None])
        self.mask = allowed[:, None, :, :]  # [B, 1, T, L], True = attend
        self.query_pos = query_pos

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **_: object):
        """Called by transformers' attention: key/value are [B, kv_heads, T, head_dim]."""
        k_buf, v_buf = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_buf[self.write_slot, :, self.write_pos] = key.transpose(1, 2)[self.valid].to(k_buf.dtype)
        v_buf[self.write_slot, :, self.write_pos] = value.transpose(1, 2)[self.valid].to(v_buf.dtype)
        return k_buf[self.slots, :, : self.kv_len], v_buf[self.slots, :, : self.kv_len]
