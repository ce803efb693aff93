"""The worker hand-off transport: references into rings cross the pipe, data comes back bit-exact, rings
wrap, what cannot fit is pickled inline (never a deadlock), and device tensors stay on the device (a
GPU test across two processes through CUDA IPC; on the CPU the device ring's logic runs on a ring in
host memory)."""

from __future__ import annotations

import dataclasses
import os
import queue

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from omnirt.pipeline.replicas.channel import Channel, DeviceRing, ShmRing, remove_driver_files

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8)


def _tensors(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, dtype in enumerate(DTYPES):
        shape = (1 + (seed + i) % 7, 3 + i)
        t = torch.randint(0, 100, shape, generator=g) if dtype != torch.float32 else torch.randn(shape, generator=g)
        out.append(t.to(dtype).to(device))
    out.append(torch.randn(4, 6, generator=g).t().to(device))  # not contiguous
    out.append(torch.empty(0, 5).to(device))
    return out


def _message(seed: int, device: str = "cpu") -> dict:
    return {"rows": _tensors(seed, device), "pcm": np.arange(seed * 10, dtype=np.float32), "id": f"r{seed}"}


def _same(a: dict, b: dict) -> bool:
    return (a["id"] == b["id"] and np.array_equal(a["pcm"], b["pcm"]) and len(a["rows"]) == len(b["rows"])
            and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
                    for x, y in zip(a["rows"], b["rows"])))


def _pair(ring_bytes: int, device_ring: bool = False) -> tuple[Channel, Channel]:
    """Both ends of one channel in this process; the device ring (if any) in host memory."""
    writer = Channel.create(queue.Queue(), ring_bytes, device_ring)
    reader = Channel(writer.queue, writer.ring, device_cursors=writer.device_cursors)
    if device_ring:
        data = torch.zeros(writer.device_cursors.capacity, dtype=torch.uint8)
        writer.device_ring = reader.device_ring = DeviceRing(writer.device_cursors, data)
    return writer, reader


@pytest.mark.parametrize("device_ring", [False, True], ids=["host-ring", "device-ring"])
def test_messages_come_back_exact_through_a_wrapping_ring(device_ring):
    writer, reader = _pair(16 * 1024, device_ring)
    try:
        for seed in range(60):  # ~1.6 KiB a message: the ring wraps several times
            msg = _message(seed)
            writer.put(msg)
            assert _same(reader.get(timeout=30), msg)
        s = writer.stats
        assert s.num_messages == 60 and s.num_inline_bytes == 0
        assert (s.num_device_bytes > 0) == device_ring  # tensors took the device ring where there is one
        assert s.num_shm_bytes > 0  # the numpy PCM always crosses host memory
        assert writer.ring.head > 2 * writer.ring.capacity
        if device_ring:
            assert writer.device_cursors.head > 2 * writer.device_cursors.capacity
    finally:
        writer.close()


@pytest.mark.parametrize("device_ring", [False, True], ids=["host-ring", "device-ring"])
def test_a_message_larger_than_the_ring_goes_inline_without_waiting(device_ring):
    writer, reader = _pair(4096, device_ring)
    try:
        big = {"rows": [torch.arange(512, dtype=torch.int64) + i for i in range(4)], "pcm": np.ones(3, np.float32),
               "id": "big"}  # 4 x 4 KiB: each fits alone, all four never do
        writer.put(big)  # would wait forever for room its own reader cannot release before it is sent
        assert _same(reader.get(timeout=30), big)
        assert writer.stats.num_inline_bytes > 0
        small = _message(3)
        writer.put(small)
        assert _same(reader.get(timeout=30), small)
    finally:
        writer.close()


def test_received_device_tensors_are_views_of_one_copy_per_message():
    writer, reader = _pair(64 * 1024, device_ring=True)
    try:
        writer.put(_message(5))
        rows = reader.get(timeout=30)["rows"]
        storages = {t.untyped_storage().data_ptr() for t in rows if t.numel()}
        assert len(storages) == 1  # the reader copied the message's span once
        assert writer.device_cursors.head == int(writer.device_cursors._cursors[1])  # and released it
    finally:
        writer.close()


def test_a_closed_ring_unblocks_a_waiting_writer():
    writer, _ = _pair(4096)
    try:
        writer.put({"a": np.zeros(3000, np.uint8)})  # unread: the ring is nearly full
        writer.mark_closed()
        with pytest.raises(Exception, match="closed"):
            writer.put({"a": np.zeros(3000, np.uint8)})
    finally:
        writer.close()


def test_cursor_rings_without_data_hold_only_their_header():
    ring = ShmRing(1 << 20, with_data=False)
    try:
        assert ring.capacity == 1 << 20 and ring.shm.size < 4096 and ring.data is None
        other = ShmRing(ring.capacity, ring.name, with_data=False)
        assert ring.alloc(100) == 0 and other.head == 128
        other.close()
    finally:
        ring.close()


# ---- CUDA IPC across two processes -----------------------------------------------------------------------


def _echo_worker(inbox_spec: tuple, outbox_spec: tuple) -> None:
    """A worker that sends its device rings' handles, then returns every message with its tensors doubled."""
    from omnirt.pipeline.replicas.worker import DeviceLink

    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    outbox = Channel.attach(outbox_spec, device)
    inbox = Channel.attach(inbox_spec, device, consumer_stream=stream)
    outbox.put(DeviceLink(inbox.device_handle(), outbox.device_handle()))
    with torch.cuda.stream(stream):
        while (msg := inbox.get()) is not None:
            assert all(t.is_cuda for t in msg["rows"])
            msg["rows"] = [t * 2 if t.dtype != torch.bool else t for t in msg["rows"]]
            stream.synchronize()
            outbox.put(msg)
    outbox.put({"stats": dataclasses.replace(outbox.stats)})
    inbox.close()
    outbox.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_device_tensors_cross_processes_on_the_device():
    shm_before = set(os.listdir("/dev/shm"))
    ctx = mp.get_context("spawn")
    inbox = Channel.create(ctx.Queue(), 256 * 1024, device_ring=True)
    outbox = Channel.create(ctx.Queue(), 256 * 1024, device_ring=True)
    proc = ctx.Process(target=_echo_worker, args=(inbox.spec(), outbox.spec()), daemon=True)
    proc.start()
    try:
        link = outbox.get(timeout=120)
        inbox.open_device_ring(link.inbox)
        outbox.open_device_ring(link.outbox)
        sent = [_message(seed, "cuda") for seed in range(200)]  # the 256 KiB rings wrap many times
        for msg in sent[:8]:
            inbox.put(msg)  # a few in flight before the first read
        for i, msg in enumerate(sent):
            if i + 8 < len(sent):
                inbox.put(sent[i + 8])
            got = outbox.get(timeout=60)
            want = {**msg, "rows": [t * 2 if t.dtype != torch.bool else t for t in msg["rows"]]}
            assert all(t.is_cuda for t in got["rows"]) and _same(got, want)
        inbox.put_end()
        worker_stats = outbox.get(timeout=60)["stats"]
        proc.join(timeout=30)
        assert proc.exitcode == 0
        for stats in (inbox.stats, worker_stats):  # both writers
            assert stats.num_device_bytes > 0 and stats.num_inline_bytes == 0
        # device tensors never crossed host memory: only the PCM (and the link) did
        pcm_bytes = sum(m["pcm"].nbytes for m in sent)
        assert inbox.stats.num_shm_bytes == pcm_bytes
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        inbox.close()
        outbox.close()
        remove_driver_files(proc.pid)
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if not n.startswith("sem.")}  # the queues' own
    assert left == set()  # no ring, CUDA IPC reference counter or driver file
