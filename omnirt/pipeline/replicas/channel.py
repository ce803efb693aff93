"""Hand-off transport between the engine and a worker process of the same host.

A `Channel` is one direction between the engine and one worker: a multiprocessing queue (the pipe)
for pickled metadata, and rings for the data. Every tensor and numpy array of a message is swapped
for a reference into a ring; only the references cross the pipe.

- `ShmRing`: a byte ring in POSIX shared memory, for host data (numpy arrays, CPU tensors, and device
  tensors where the platform cannot share device memory). The reader copies the bytes out.
- `DeviceRing`: a byte ring in the worker's device memory, opened by the engine through a CUDA IPC
  handle (CUDA and ROCm), for device tensors. The writer copies a message's tensors into it in one
  batched copy and waits for that copy alone (it writes between steps, its stage's stream idle); the
  reader copies the message's span out on a stream of its own in one copy (two where it wraps), waits
  for that copy only, and releases the span. Device data never crosses host memory, and neither side
  waits for the other's running step. (No interprocess events: the CUDA driver leaves a file in
  /dev/shm behind for every process that makes one.)

Each ring is a single-producer single-consumer queue whose order is the pipe's order: the writer
reserves space in `put` (under a lock: several writer threads), the reader releases it once the data
is copied out. Data that cannot fit (larger than a ring, or a message larger than a ring in all) is
pickled inline through the pipe, and counted.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch

_HEADER_BYTES = 64  # int64 head (bytes ever reserved), int64 tail (bytes ever released)
_ALIGN = 64  # every reservation starts 64-byte aligned, so a reference may be viewed as any dtype


class ChannelClosed(RuntimeError):
    pass


class ShmRing:
    """A byte ring whose cursors (and, by default, data) live in POSIX shared memory. The creator owns
    (unlinks) it; the other side attaches by name. `with_data=False` keeps only the cursors, for a ring
    whose data lives elsewhere (`DeviceRing`)."""

    def __init__(self, capacity: int = 0, name: str | None = None, with_data: bool = True):
        size = _HEADER_BYTES + (capacity if with_data else 0)
        self.shm = SharedMemory(name=name, create=name is None, size=size if name is None else 0)
        self.is_owner = name is None
        self.capacity = self.shm.size - _HEADER_BYTES if with_data else capacity
        self._cursors = np.ndarray((2,), dtype=np.int64, buffer=self.shm.buf)
        if self.is_owner:
            self._cursors[:] = 0
        self.data = self.shm.buf[_HEADER_BYTES:] if with_data else None
        self.closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def head(self) -> int:
        return int(self._cursors[0])

    def alloc(self, nbytes: int, since: int | None = None, timeout_s: float = 30.0) -> int | None:
        """Reserve `nbytes` (producer side) and return where they start as a head value (the ring offset
        is that modulo `capacity`); None if they can never fit — more than the ring, or more than the
        ring counted from head value `since` (the start of the message being written, which the reader
        cannot release before the whole message is sent)."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        head = int(self._cursors[0])
        pos = head % self.capacity if self.capacity else 0
        if pos + size > self.capacity:  # no room before the end: skip to the start
            head += self.capacity - pos
        if head + size - (head if since is None else since) > self.capacity:
            return None
        deadline = time.monotonic() + timeout_s
        while head + size - int(self._cursors[1]) > self.capacity:
            if self.closed or time.monotonic() > deadline:
                raise ChannelClosed("ring is closed or its reader stopped reading")
            time.sleep(0.0005)
        self._cursors[0] = head + size
        return head

    def release(self, end: int) -> None:
        """Consumer side: everything before head value `end` has been copied out."""
        self._cursors[1] = end

    def close(self) -> None:
        self.closed = True
        del self._cursors
        if self.data is not None:
            self.data.release()
        self.shm.close()
        if self.is_owner:
            self.shm.unlink()


class DeviceRing:
    """A byte ring in device memory (`data`, uint8), its cursors in a data-less `ShmRing`. The worker
    fills in the memory on its device (`create`); the engine opens it from `handle()` (`open`), mapping the
    device by UUID since the two processes number devices differently. The engine owns the cursors (so
    that nothing is left in /dev/shm when a worker is killed); the worker owns the memory."""

    def __init__(self, cursors: ShmRing, data: torch.Tensor):
        self.cursors, self.data = cursors, data
        self.device = data.device
        self._stream: Any = None  # the reader's copy stream, made on first use (in the reader's thread)

    @classmethod
    def create(cls, cursors: ShmRing, device: torch.device) -> DeviceRing:
        """The worker side: device memory for the engine-owned `cursors`."""
        return cls(cursors, torch.empty(cursors.capacity, dtype=torch.uint8, device=device))

    def handle(self) -> tuple:
        """What the other process needs to `open` this ring (pickled once, at start-up)."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.data)
        return args, str(torch.cuda.get_device_properties(self.device).uuid)

    @classmethod
    def open(cls, cursors: ShmRing, handle: tuple) -> DeviceRing:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args, uuid = handle
        data = rebuild_cuda_tensor(*args[:6], _device_index(uuid), *args[7:])  # args[6]: the creator's numbering
        return cls(cursors, data)

    def write(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """Writer: copy a message's tensors into their reserved places, all at once, and wait for that copy.
        Puts happen between steps, after the writing stage synchronised its stream, so this waits for the
        copy alone; the reader may then read as soon as the message arrives (no interprocess event)."""
        if self.device.type == "cpu":
            torch._foreach_copy_(dst, src)
            return
        with torch.cuda.device(self.device):
            torch._foreach_copy_(dst, src)
            torch.cuda.current_stream(self.device).synchronize()

    def read(self, start: int, end: int) -> torch.Tensor:
        """Reader: a copy of head values [start, end) on the ring's device, complete when this returns; made
        on a stream of the reader's own, so that it never waits for the reading stage's running step."""
        n, cap = end - start, self.cursors.capacity
        pos = start % cap
        first = min(n, cap - pos)
        if self.device.type != "cpu" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            out = torch.cat((self.data[pos:pos + first], self.data[:n - first]))
        if self._stream is not None:
            self._stream.synchronize()
        return out


def remove_driver_files(pid: int) -> None:
    """Once a worker that exported device memory has exited (or been killed): remove the file that the CUDA
    driver made in /dev/shm for its IPC (`cuda.shm.<uid>.<pid in hex>.<n>`) and did not remove."""
    for path in glob.glob(f"/dev/shm/cuda.shm.*.{pid:x}.*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(f"device {uuid} of a worker's ring is not visible to this process")


@dataclass(slots=True)
class TransportStats:
    num_messages: int = 0
    num_shm_bytes: int = 0
    num_device_bytes: int = 0  # device tensors that stayed on the device (DeviceRing)
    num_inline_bytes: int = 0  # data that could not fit a ring, pickled through the pipe


class _RingPickler(pickle.Pickler):
    """Swaps tensors and arrays for ring references; device tensors are copied into the device ring all
    at once in `flush`, after the whole message is reserved."""

    def __init__(self, file, ring: ShmRing, device_ring: DeviceRing | None, stats: TransportStats):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.ring, self.device_ring, self.stats = ring, device_ring, stats
        self.host_start: int | None = None
        self.span: tuple[int, int] | None = None  # head values [start, end) of this message's device data
        self._dst: list[torch.Tensor] = []
        self._src: list[torch.Tensor] = []

    def persistent_id(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            if self.device_ring is not None and obj.device.type == self.device_ring.device.type:
                ref = self._put_device(obj)
                if ref is not None:
                    return ref
            host = obj.detach().contiguous().cpu()
            ref = self._put(host.reshape(-1).view(torch.uint8).numpy())
            return None if ref is None else ("t", *ref, _dtype_name(host.dtype), tuple(host.shape), obj.device.type)
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            ref = self._put(np.ascontiguousarray(obj).reshape(-1).view(np.uint8))
            return None if ref is None else ("a", *ref, obj.dtype.str, obj.shape)
        return None

    def _put(self, raw: np.ndarray) -> tuple[int, int] | None:
        if not raw.nbytes:
            return 0, 0
        head = self.ring.alloc(raw.nbytes, self.host_start)
        if head is None:
            self.stats.num_inline_bytes += raw.nbytes
            return None
        self.host_start = head if self.host_start is None else self.host_start
        offset = head % self.ring.capacity
        self.ring.data[offset:offset + raw.nbytes] = raw.data
        self.stats.num_shm_bytes += raw.nbytes
        return offset, raw.nbytes

    def _put_device(self, t: torch.Tensor) -> tuple | None:
        if not t.numel():
            return "d", 0, 0, _dtype_name(t.dtype), tuple(t.shape)
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        cursors, start = self.device_ring.cursors, self.span[0] if self.span else None
        head = cursors.alloc(raw.numel(), start)
        if head is None:
            return None
        offset = head % cursors.capacity
        self._dst.append(self.device_ring.data[offset:offset + raw.numel()])
        self._src.append(raw)
        self.span = (head if start is None else start, cursors.head)
        self.stats.num_device_bytes += raw.numel()
        return "d", head, raw.numel(), _dtype_name(t.dtype), tuple(t.shape)

    def flush(self) -> None:
        """Copy the message's device tensors into their reserved places."""
        if self._dst:
            self.device_ring.write(self._dst, self._src)


class _RingUnpickler(pickle.Unpickler):
    def __init__(self, file, ring: ShmRing, device: torch.device, device_ring: DeviceRing | None,
                 span: torch.Tensor | None, span_start: int):
        super().__init__(file)
        self.ring, self.device, self.device_ring = ring, device, device_ring
        self.span, self.span_start = span, span_start

    def persistent_load(self, pid):
        kind, offset, nbytes = pid[:3]
        if kind == "d":
            dtype, shape = getattr(torch, pid[3]), pid[4]
            if not nbytes:
                return torch.empty(shape, dtype=dtype, device=self.device_ring.device)
            i = offset - self.span_start
            return self.span[i:i + nbytes].view(dtype).reshape(shape)
        raw = bytes(self.ring.data[offset:offset + nbytes])  # the copy out of the ring
        if kind == "a":
            return np.frombuffer(raw, dtype=np.dtype(pid[3])).reshape(pid[4]).copy()
        dtype, shape, device_type = getattr(torch, pid[3]), pid[4], pid[5]
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        t = t.reshape(shape)
        return t if device_type == "cpu" else t.to(self.device)


class Channel:
    """One direction of engine <-> worker traffic: `put` on one side, `get` on the other.

    The engine side `create`s it (the pipe, the host ring and, where the platform shares device memory,
    the cursors of a device ring) and passes `spec()` through the process arguments; the worker
    `attach`es, making the device ring's memory on its device, and sends `device_handle()` back, which
    the engine side `open_device_ring`s. Until then device tensors are staged through the host ring.
    On the reading side, device tensors land on the device ring's device and host-staged ones on
    `device`; `consumer_stream` (the reading stage's stream) is recorded on each received device buffer,
    so that the allocator does not reuse it while that stream may still read it."""

    def __init__(self, queue: Any, ring: ShmRing, device: torch.device | None = None,
                 device_cursors: ShmRing | None = None, consumer_stream: Any = None):
        self.queue, self.ring, self.device_cursors = queue, ring, device_cursors
        self.device = device or torch.device("cpu")
        self.device_ring: DeviceRing | None = None
        self.consumer_stream = consumer_stream
        self.stats = TransportStats()
        self._lock = threading.Lock()

    @classmethod
    def create(cls, queue: Any, ring_bytes: int, device_ring: bool = False) -> Channel:
        capacity = -(-ring_bytes // _ALIGN) * _ALIGN
        return cls(queue, ShmRing(capacity), device_cursors=ShmRing(capacity, with_data=False) if device_ring else None)

    def spec(self) -> tuple:
        cursors = self.device_cursors
        return self.queue, self.ring.name, (cursors.name, cursors.capacity) if cursors is not None else None

    @classmethod
    def attach(cls, spec: tuple, device: torch.device | None = None, consumer_stream: Any = None) -> Channel:
        """The worker side; with a device ring where the engine made its cursors and `device` is a GPU."""
        queue, name, cursors = spec
        channel = cls(queue, ShmRing(name=name), device, consumer_stream=consumer_stream)
        if cursors is not None and channel.device.type == "cuda":
            channel.device_cursors = ShmRing(cursors[1], cursors[0], with_data=False)
            channel.device_ring = DeviceRing.create(channel.device_cursors, channel.device)
        return channel

    def device_handle(self) -> tuple | None:
        return self.device_ring.handle() if self.device_ring is not None else None

    def open_device_ring(self, handle: tuple) -> None:
        self.device_ring = DeviceRing.open(self.device_cursors, handle)

    def put(self, obj: Any) -> None:
        with self._lock:  # several producer threads: reservation order must equal pipe order
            buf = io.BytesIO()
            pickler = _RingPickler(buf, self.ring, self.device_ring, self.stats)
            pickler.dump(obj)
            pickler.flush()
            self.stats.num_messages += 1
            self.queue.put((buf.getvalue(), self.ring.head, pickler.span))

    def put_end(self) -> None:
        """Tell the reader there is nothing more: its `get` returns None."""
        self.queue.put(None)

    def get(self, timeout: float | None = None) -> Any:
        """The next message, None after `put_end` (raises queue.Empty after `timeout`)."""
        item = self.queue.get(timeout=timeout)
        if item is None:
            return None
        data, end, span = item
        ring, buf = self.device_ring, None
        if span is not None:
            if ring is None:
                raise ChannelClosed("a message in a device ring that this side has closed")
            buf = ring.read(*span)
            if self.consumer_stream is not None:
                buf.record_stream(self.consumer_stream)
            ring.cursors.release(span[1])
        obj = _RingUnpickler(io.BytesIO(data), self.ring, self.device, ring, buf, span[0] if span else 0).load()
        self.ring.release(end)
        return obj

    def mark_closed(self) -> None:
        """Unblock a writer waiting for room that a dead reader will never release."""
        for ring in (self.ring, self.device_cursors):
            if ring is not None:
                ring.closed = True

    def unmap_device_ring(self) -> None:
        """Let go of the device ring's memory and events (the engine, before its worker exits: the worker
        owns them, and CUDA IPC wants the importer to let go first)."""
        self.device_ring = None

    def close(self) -> None:
        self.ring.close()
        if self.device_cursors is not None:
            self.device_cursors.close()
        self.unmap_device_ring()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
