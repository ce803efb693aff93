"""Per-step host values (token ids, slots, positions, sampling settings) to the device through pinned memory,
and a step's sampled tokens back the same way.

`torch.tensor(values, device=cuda)` copies from pageable memory: the host thread waits about 200 µs per
call, and a c=64 round on the H200 spent 2.3 s in such copies. `PinnedBuffers` writes the values into a
preallocated pinned buffer and issues one asynchronous copy per call into a device buffer of the same
size. Regions of both are reused round-robin. That is safe because a stage waits for every step's results
before it issues the step after the next one (`omnirt/pipeline/stage/loop.py`): a region is reused only once the ring
has gone round, after the step that wrote it has finished, as long as two steps together copy less than
the capacity (a c=64 Talker step copies a few hundred values; a call over the capacity falls back to a
plain copy). Back to the host, `start_fetch` copies into pinned memory and records an event after the
copy; `Fetch.wait()` waits on that event, not on the whole stream. One `PinnedBuffers` per stage model or
sampler: it is used from that stage's thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16  # every staged tensor starts here: Triton specialises a kernel on its pointers' 16-byte alignment
CAPACITY = 1 << 18  # values per dtype (2 MiB of int64): a c=64 Talker step with its history stages ~10 k
FETCH_CAPACITY = 1 << 13  # values per dtype coming back (a step's sampled tokens and codec frames)


class PinnedBuffers:
    def __init__(self, device: torch.device, capacity: int = CAPACITY):
        self.device = device
        self.capacity = capacity
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offsets: dict[torch.dtype, int] = {}
        self._fetched: dict[torch.dtype, torch.Tensor] = {}  # [2, FETCH_CAPACITY] each: two fetches in flight
        self._half = 0

    def tensors(self, *rows: Sequence, dtype: torch.dtype = torch.long) -> list[torch.Tensor]:
        """Each sequence of numbers as a 1-D device tensor, all through one copy, each 16-byte aligned (a
        kernel that takes it is not compiled again for another alignment)."""
        sizes = [len(r) for r in rows]
        starts = aligned_starts(sizes, _align(dtype))
        if self.device.type == "cpu" or starts[-1] > self.capacity:
            return list(torch.tensor([x for r in rows for x in r], dtype=dtype, device=self.device).split(sizes))
        flat = []
        for r, a, b in zip(rows, starts, starts[1:]):
            flat.extend(r)
            flat.extend([0] * (b - a - len(r)))
        region = self._staged(torch.tensor(flat, dtype=dtype))
        return [region[a:a + n] for a, n in zip(starts, sizes)]

    def copy(self, values: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, through one asynchronous copy from pinned memory (e.g. a grammar mask)."""
        if self.device.type == "cpu":
            return values
        if values.numel() > self.capacity:
            return values.to(self.device)
        return self._staged(values.flatten()).view(values.shape)

    def _staged(self, flat: torch.Tensor) -> torch.Tensor:
        """1-D host values in the next region of the device buffer of their dtype."""
        n, dtype = flat.numel(), flat.dtype
        host, dev = self._buffers_for(dtype)
        start = _round_up(self._offsets.get(dtype, 0), _align(dtype))
        if start + n > self.capacity:
            start = 0
        host[start:start + n] = flat
        region = dev[start:start + n]
        region.copy_(host[start:start + n], non_blocking=True)
        self._offsets[dtype] = start + n
        return region

    def tensor(self, values: Sequence, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self.tensors(values, dtype=dtype)[0]

    def fetch(self, *values: torch.Tensor) -> list:
        """Device tensors' values as lists (the list itself for one tensor), in one wait."""
        return self.start_fetch(*values).wait()

    def start_fetch(self, *values: torch.Tensor) -> Fetch:
        """Asynchronous copies of device tensors into pinned memory; `wait()` on the result gives their values.
        The pinned buffers alternate between two halves, so one fetch may be in flight while the next starts
        (a stage with async scheduling has at most two). With no values the event alone marks the step's end."""
        if self.device.type == "cpu" or sum(v.numel() for v in values) > FETCH_CAPACITY:
            return Fetch(list(values), None)
        hosts, offsets = [], {}
        self._half ^= 1
        for v in values:
            if v.dtype not in self._fetched:
                self._fetched[v.dtype] = torch.empty(2, FETCH_CAPACITY, dtype=v.dtype, pin_memory=True)
            start = offsets.get(v.dtype, 0)
            offsets[v.dtype] = start + v.numel()
            host = self._fetched[v.dtype][self._half, start:start + v.numel()].view(v.shape)
            host.copy_(v, non_blocking=True)
            hosts.append(host)
        done = torch.Event(device=self.device)
        done.record()
        return Fetch(hosts, done)

    def _buffers_for(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._buffers:
            self._buffers[dtype] = (torch.empty(self.capacity, dtype=dtype, pin_memory=True),
                                    torch.empty(self.capacity, dtype=dtype, device=self.device))
        return self._buffers[dtype]


def _align(dtype: torch.dtype) -> int:
    """Values of `dtype` per `ALIGN_BYTES`."""
    return max(1, ALIGN_BYTES // dtype.itemsize)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def aligned_starts(sizes: Sequence[int], align: int) -> list[int]:
    """Where each of `sizes` values starts when each starts at a multiple of `align`, and the end of the last
    one rounded up the same way."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + _round_up(n, align))
    return starts


class Fetch:
    """Values on their way to the host: `wait()` blocks on the copies (not the whole stream) and lists them."""

    def __init__(self, tensors: list[torch.Tensor], done: torch.Event | None):
        self.tensors, self.done = tensors, done

    def wait(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        out = [t.tolist() for t in self.tensors]
        return out[0] if len(out) == 1 else out
