"""Hand-off transport between processes of one host: a pipe for metadata, shared memory for data.

A `Channel` is one direction between the engine and one worker. Messages are pickled with every
tensor and numpy array swapped for a reference into a shared-memory ring (offset, size, dtype,
shape); only those references cross the pipe. The reader copies the data out and then releases
the ring up to the message's end, so the ring is a single-producer single-consumer queue whose
order is the pipe's order. Device tensors are staged through the host ring and land on the
reader's device. Data larger than the whole ring falls back to inline pickling and is counted.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch

_HEADER_BYTES = 64  # int64 head (bytes ever written), int64 tail (bytes ever released)
_ALIGN = 64


class ChannelClosed(RuntimeError):
    pass


class ShmRing:
    """A byte ring in POSIX shared memory. The creator owns (unlinks) it; the other side attaches by name."""

    def __init__(self, capacity: int = 0, name: str | None = None):
        self.shm = SharedMemory(name=name, create=name is None, size=_HEADER_BYTES + capacity if name is None else 0)
        self.is_owner = name is None
        self.capacity = self.shm.size - _HEADER_BYTES
        self._cursors = np.ndarray((2,), dtype=np.int64, buffer=self.shm.buf)
        if self.is_owner:
            self._cursors[:] = 0
        self.data = self.shm.buf[_HEADER_BYTES:]
        self.closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def head(self) -> int:
        return int(self._cursors[0])

    def alloc(self, nbytes: int, timeout_s: float = 30.0) -> int | None:
        """Reserve `nbytes` (producer side); returns the data offset, or None if it can never fit."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        if size > self.capacity:
            return None
        head = int(self._cursors[0])
        pos = head % self.capacity
        if pos + size > self.capacity:  # no room before the end: skip to the start
            head, pos = head + self.capacity - pos, 0
        deadline = time.monotonic() + timeout_s
        while head + size - int(self._cursors[1]) > self.capacity:
            if self.closed or time.monotonic() > deadline:
                raise ChannelClosed("shared-memory ring is closed or its reader stopped reading")
            time.sleep(0.0005)
        self._cursors[0] = head + size
        return pos

    def release(self, end: int) -> None:
        """Consumer side: everything before `end` (a head value) has been copied out."""
        self._cursors[1] = end

    def close(self) -> None:
        self.closed = True
        del self._cursors
        self.data.release()
        self.shm.close()
        if self.is_owner:
            self.shm.unlink()


@dataclass(slots=True)
class TransportStats:
    num_messages: int = 0
    num_shm_bytes: int = 0
    num_inline_bytes: int = 0  # tensors too large for the ring, pickled through the pipe


class _RingPickler(pickle.Pickler):
    def __init__(self, file, ring: ShmRing, stats: TransportStats):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.ring, self.stats = ring, stats

    def persistent_id(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            host = obj.detach().contiguous().cpu()
            raw = host.reshape(-1).view(torch.uint8).numpy()
            ref = self._put(raw)
            return None if ref is None else ("t", *ref, str(host.dtype).removeprefix("torch."), tuple(host.shape),
                                             obj.device.type)
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            ref = self._put(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
            return None if ref is None else ("a", *ref, obj.dtype.str, obj.shape)
        return None

    def _put(self, raw: np.ndarray) -> tuple[int, int] | None:
        offset = self.ring.alloc(raw.nbytes) if raw.nbytes else 0
        if offset is None:
            self.stats.num_inline_bytes += raw.nbytes
            return None
        self.ring.data[offset:offset + raw.nbytes] = raw.data
        self.stats.num_shm_bytes += raw.nbytes
        return offset, raw.nbytes


class _RingUnpickler(pickle.Unpickler):
    def __init__(self, file, ring: ShmRing, device: torch.device):
        super().__init__(file)
        self.ring, self.device = ring, device

    def persistent_load(self, pid):
        kind, offset, nbytes = pid[:3]
        raw = bytes(self.ring.data[offset:offset + nbytes])  # the copy out of the ring
        if kind == "a":
            return np.frombuffer(raw, dtype=np.dtype(pid[3])).reshape(pid[4]).copy()
        dtype, shape, device_type = getattr(torch, pid[3]), pid[4], pid[5]
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        t = t.reshape(shape)
        return t if device_type == "cpu" else t.to(self.device)


class Channel:
    """One direction of engine <-> worker traffic: `put` on one side, `get` on the other.

    `queue` is a multiprocessing queue (the pipe); `ring` is created by the engine side and
    attached by name in the worker (pass `ChannelSpec` through the process arguments)."""

    def __init__(self, queue: Any, ring: ShmRing, device: torch.device | None = None):
        self.queue, self.ring = queue, ring
        self.device = device or torch.device("cpu")
        self.stats = TransportStats()
        self._lock = threading.Lock()

    def put(self, obj: Any) -> None:
        with self._lock:  # several producer threads: allocation order must equal pipe order
            buf = io.BytesIO()
            _RingPickler(buf, self.ring, self.stats).dump(obj)
            self.stats.num_messages += 1
            self.queue.put((buf.getvalue(), self.ring.head))

    def put_end(self) -> None:
        """Tell the reader there is nothing more: its `get` returns None."""
        self.queue.put(None)

    def get(self, timeout: float | None = None) -> Any:
        """The next message, None after `put_end` (raises queue.Empty after `timeout`)."""
        item = self.queue.get(timeout=timeout)
        if item is None:
            return None
        data, end = item
        obj = _RingUnpickler(io.BytesIO(data), self.ring, self.device).load()
        self.ring.release(end)
        return obj

    def spec(self) -> tuple[Any, str]:
        return self.queue, self.ring.name

    @classmethod
    def attach(cls, spec: tuple[Any, str], device: torch.device | None = None) -> Channel:
        queue, name = spec
        return cls(queue, ShmRing(name=name), device)

    def close(self) -> None:
        self.ring.close()
