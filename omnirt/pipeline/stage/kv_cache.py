"""Preallocated slot-based KV cache.

Every request that holds a slot owns row `slot` of each layer's K/V buffer for its whole life, so
decode steps index fixed buffers by (slot, position) and never allocate per-request tensors. A
`CacheView` is the per-step object that transformers' attention layers call `update()` on: it
writes the new K/V rows in place and returns what the batch attends over. With `in_place` (the
slot-attention kernel, `omnirt/pipeline/kernels/attention.py`) that is the layer's whole buffer plus a `SlotMask`;
otherwise a dense copy of the batch's rows plus a boolean mask, for transformers' SDPA. One extra
scratch slot (index `num_slots`) absorbs the writes of padded rows in captured graphs.

A slot is free, in use, or *resident*: a finished request's KV kept for a later prompt that begins the
same way (`omnirt/pipeline/stage/prefix_cache.py`). Resident slots count as free; `allocate` gives up the least
recently used one when no slot is free, to the host tier where there is one (`omnirt/pipeline/stage/host_tier.py`).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

import torch

from omnirt.pipeline.kernels.attention import SlotMask
from omnirt.pipeline.stage.cudagraph import length_buckets
from omnirt.pipeline.stage.host_tier import HostTier, Offloaded
from omnirt.pipeline.stage.pinned import PinnedBuffers


class SlotKVCache:
    """K/V buffers of shape [layers, slots + 1, kv_heads, max_len, head_dim], plus the free-slot list."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, in_place: bool = False, host_bytes: int = 0):
        """`host_bytes`: host memory for the prefixes of resident slots given up (0: none, they are dropped)."""
        shape = (num_layers, num_slots + 1, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_len = max_len
        self.in_place = in_place  # attention reads the slots themselves: no dense copy, no kv_len buckets
        self._free: deque[int] = deque(range(num_slots))
        self.resident: OrderedDict[int, Any] = OrderedDict()  # slot -> what it holds, least recently used first
        self._staging: PinnedBuffers | None = None  # for `view` (one stage's thread uses a cache)
        self.host = HostTier(host_bytes) if host_bytes else None
        self.num_given_up = 0  # resident slots given up for a slot, since start-up

    @property
    def num_free_slots(self) -> int:
        """Slots a new request can get: the free ones and the resident ones."""
        return len(self._free) + len(self.resident)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def graph_lengths(self) -> list[int] | None:
        """The KV lengths a captured step needs a graph for: one per dense-copy size, none in place."""
        return None if self.in_place else length_buckets(self.max_len)

    def allocate(self) -> int:
        """A free slot, else the least recently used resident one (what it held goes to the host tier, if any)."""
        if self._free:
            return self._free.popleft()
        slot, held = self.resident.popitem(last=False)
        self._give_up(slot, held)
        return slot

    def spare(self, keep: int) -> int | None:
        """A slot for a copy of resident slot `keep`'s prefix: a free one, else the least recently used
        resident one but `keep` (None: `keep` is the only one)."""
        if self._free:
            return self._free.popleft()
        victim = next((s for s in self.resident if s != keep), None)
        if victim is not None:
            self._give_up(victim, self.resident.pop(victim))
        return victim

    def _give_up(self, slot: int, held: Any) -> None:
        """A resident slot is given up for another request: counted, and its prefix to the host tier if there is
        one (async copies on the current stream, which orders them before anything that writes the slot next)."""
        self.num_given_up += 1
        layers, _, heads, _, head_dim = self.k.shape
        shape = (layers, heads, held.num_tokens, head_dim)
        if self.host is None or 2 * math.prod(shape) * self.k.element_size() > self.host.max_bytes:
            return
        pin = self.k.device.type != "cpu"
        k, v = (torch.empty(shape, dtype=self.k.dtype, pin_memory=pin) for _ in range(2))
        k.copy_(self.k[:, slot, :, :held.num_tokens], non_blocking=True)
        v.copy_(self.v[:, slot, :, :held.num_tokens], non_blocking=True)
        self.host.add(Offloaded(k, v, held.to(torch.device("cpu"))))

    def restore(self, entry: Offloaded, slot: int, num_tokens: int) -> Any:
        """The first `num_tokens` positions of an offloaded prefix into `slot`; returns what it held, on the
        device."""
        self.k[:, slot, :, :num_tokens].copy_(entry.k[:, :, :num_tokens], non_blocking=True)
        self.v[:, slot, :, :num_tokens].copy_(entry.v[:, :, :num_tokens], non_blocking=True)
        return entry.held.to(self.k.device)

    def free(self, slot: int) -> None:
        assert slot not in self._free and slot not in self.resident, f"slot {slot} freed twice"
        self._free.append(slot)

    def park(self, slot: int, held: Any) -> None:
        """Keep an ended request's slot resident, holding `held` (`omnirt/pipeline/prefix_cache.Held`)."""
        assert slot not in self._free and slot not in self.resident, f"slot {slot} freed twice"
        self.resident[slot] = held

    def claim(self, slot: int) -> Any:
        """Take a resident slot over: it is in use again; returns what it held."""
        return self.resident.pop(slot)

    def touch(self, slot: int) -> None:
        """A resident slot was useful: it is the last one given up."""
        self.resident.move_to_end(slot)

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """The KV of positions [0, num_tokens) of slot `src` into slot `dst`, every layer."""
        self.k[:, dst, :, :num_tokens] = self.k[:, src, :, :num_tokens]
        self.v[:, dst, :, :num_tokens] = self.v[:, src, :, :num_tokens]

    def view(self, slots: list[int], starts: list[int], lengths: list[int], width: int = 0) -> CacheView:
        """A step over `lengths[i]` new tokens of row i, written from position `starts[i]` of its slot, in a
        batch at least `width` tokens wide (padding, never written). Where
        each new token goes is worked out here on the host and staged in one pinned copy: a pageable copy,
        or a boolean-mask index on the device, would wait for the stream (the latter in every layer)."""
        kv_len = max(s + n for s, n in zip(starts, lengths, strict=True))
        rows = [b for b, n in enumerate(lengths) for _ in range(n)]
        offsets = [t for n in lengths for t in range(n)]
        write_slots = [slots[b] for b in rows]
        write_pos = [starts[b] + t for b, t in zip(rows, offsets)]
        self._staging = self._staging or PinnedBuffers(self.k.device)
        t_slots, t_starts, t_lengths, *writes = self._staging.tensors(slots, starts, lengths, rows, offsets,
                                                                      write_slots, write_pos)
        return CacheView(self, t_slots, t_starts, t_lengths, max(width, *lengths), kv_len, tuple(writes))

    def padded_view(self, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, width: int) -> CacheView:
        """A prefill step over a [B, width] batch whose row i has `lengths[i]` real tokens, built from tensors
        only (the shape a captured prefill graph replays, in place only): every position of the batch writes,
        the padding ones to the scratch slot, so the count of writes is fixed by the shape."""
        assert self.in_place, "prefill graphs need the slot attention (no dense copy)"
        offsets = torch.arange(width, device=slots.device)
        valid = offsets[None, :] < lengths[:, None]  # [B, width]
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(valid).reshape(-1)
        write_slots = torch.where(valid, slots[:, None], self.scratch_slot).reshape(-1)
        write_pos = torch.where(valid, starts[:, None] + offsets, offsets).reshape(-1)
        writes = (rows, offsets.expand_as(valid).reshape(-1), write_slots, write_pos)
        return CacheView(self, slots, starts, lengths, width, None, writes)

    def dense_view(self, slots: torch.Tensor, starts: torch.Tensor, num_new: int, kv_len: int | None) -> CacheView:
        """Every row writes exactly `num_new` tokens: built from tensors only, so it is the shape a
        captured graph replays (decode steps, the code predictor's fixed-length loop). `kv_len` bounds the
        dense copy; in place it is not needed (None)."""
        return CacheView(self, slots, starts, None, num_new, kv_len)


class CacheView:
    """One step's window on the cache: where new K/V rows go and which keys each query may see."""

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, starts: torch.Tensor,
                 lengths: torch.Tensor | None, num_new: int, kv_len: int | None,
                 writes: tuple[torch.Tensor, ...] | None = None):
        """`lengths` None: every row has exactly `num_new` new tokens (dense). Otherwise `writes` = (batch row,
        offset in the step, slot, position) of each real new token: padded query rows are not written."""
        assert kv_len is None or kv_len <= cache.max_len, "sequence longer than the KV cache"
        self.cache, self.slots, self.num_new, self.kv_len = cache, slots, num_new, kv_len
        self.lengths, self.writes = lengths, writes
        offs = torch.arange(num_new, device=slots.device)
        self.query_pos = starts[:, None] + offs[None, :]  # [B, T]
        if cache.in_place:
            self.mask = SlotMask(slots, starts, torch.full_like(slots, num_new) if lengths is None else lengths)
            return
        key_pos = torch.arange(kv_len, device=slots.device)
        allowed = key_pos[None, None, :] <= self.query_pos[:, :, None]  # causal within the new tokens
        if lengths is not None:
            allowed = allowed & (key_pos[None, None, :] < (starts + lengths)[:, None, None])
        self.mask = allowed[:, None, :, :]  # [B, 1, T, L], True = attend

    def select_layer(self, layer: int) -> None:
        """The layer whose buffers the next `update` writes (set by the caller, so that the layer index never
        reaches a compiled layer: one compiled graph then serves every layer of the stack)."""
        self.k_buf, self.v_buf = self.cache.k[layer], self.cache.v[layer]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **_: object):
        """Called by transformers' attention: key/value are [B, kv_heads, T, head_dim]; `layer_idx` is the one
        `select_layer` was given."""
        k_buf, v_buf = self.k_buf, self.v_buf
        if self.writes is None:
            k_buf[self.slots[:, None], :, self.query_pos] = key.transpose(1, 2).to(k_buf.dtype)
            v_buf[self.slots[:, None], :, self.query_pos] = value.transpose(1, 2).to(v_buf.dtype)
        else:
            row, offset, slot, pos = self.writes
            k_buf[slot, :, pos] = key.transpose(1, 2)[row, offset].to(k_buf.dtype)
            v_buf[slot, :, pos] = value.transpose(1, 2)[row, offset].to(v_buf.dtype)
        if self.cache.in_place:
            return k_buf, v_buf
        return k_buf[self.slots, :, : self.kv_len], v_buf[self.slots, :, : self.kv_len]
