"""Graph buckets: selection, padding and eager fallback on the CPU (with a stand-in for the device
graph, which cannot run here); real capture vs eager on CUDA when a GPU is present."""

from __future__ import annotations

import contextlib

import pytest
import torch

from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.cudagraph import CudaGraphCache, batch_buckets, bucket_for, length_buckets


def test_bucket_lists():
    assert batch_buckets(64)[:5] == [1, 2, 4, 8, 16] and batch_buckets(64)[-1] == 64
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert length_buckets(2048) == [128, 256, 512, 1024, 2048]
    assert length_buckets(1000) == [128, 256, 512, 1000]
    assert bucket_for(5, [1, 2, 4, 8]) == 8 and bucket_for(9, [1, 2, 4, 8]) is None


class _ReplayGraph:
    """Stands in for a CUDA graph: `replay()` re-runs the captured step on the static inputs."""

    def __init__(self):
        self.replay = None


class _FakeGraphPlatform(Platform):
    capture_streams: list = []  # the stream of every capture, in order (reset by the test that reads it)

    def __init__(self):
        super().__init__("cuda", "cpu", "gloo", supports_graphs=True)

    def new_graph(self):
        return _ReplayGraph()

    def graph_pool_handle(self):
        return object()

    def graph_context(self, graph, pool, stream=None):
        self.capture_streams.append(stream)
        return contextlib.nullcontext()

    def new_stream(self):
        return type("S", (), {"wait_stream": lambda *a: None})()

    def current_stream(self):
        return self.new_stream()

    def stream_context(self, stream):
        return contextlib.nullcontext()

    def synchronize(self, device=None):
        pass


def _step_calls():
    calls = []

    def step(length, x, slots):
        calls.append((x.shape[0], length))
        return (x * 2 + slots.float(),)

    return step, calls


def test_replay_pads_to_the_bucket_and_slices():
    step, calls = _step_calls()
    cache = CudaGraphCache("t", step, _FakeGraphPlatform(), enabled=True, batch_sizes=[1, 2, 4], lengths=[8, 16])

    def inputs(key):
        return {"x": torch.zeros(key[0]), "slots": torch.zeros(key[0], dtype=torch.long)}

    cache.capture(inputs)
    assert len(cache) == 6 and calls[0] == (4, 16)  # largest first
    for key, captured in cache._graphs.items():  # make replay recompute into the captured outputs
        captured.graph.replay = (lambda c=captured, k=key: c.outputs[0].copy_(step(k[1], **c.inputs)[0]))
    calls.clear()
    with torch.inference_mode():  # as the models call it
        (out,) = cache.run(3, 10, {"x": torch.tensor([1.0, 2.0, 3.0]), "slots": torch.tensor([0, 1, 2])},
                           {"slots": 9})
    assert calls == [(4, 16)]  # the smallest buckets holding 3 rows and length 10
    assert out.tolist() == [2.0, 5.0, 8.0]  # sliced to the real rows
    captured = cache._graphs[(4, 16)]
    assert captured.inputs["slots"].tolist() == [0, 1, 2, 9]  # padded with the scratch slot
    assert cache.num_replays == 1 and cache.num_eager == 0


def test_each_cache_captures_on_a_stream_of_its_own():
    """Graphs of two stages replay concurrently; stream-keyed library workspaces must not be shared."""
    platform = _FakeGraphPlatform()
    platform.capture_streams.clear()
    for _ in range(2):
        step, _ = _step_calls()
        CudaGraphCache("t", step, platform, enabled=True, batch_sizes=[1, 2]).capture(
                       lambda key: {"x": torch.zeros(key[0]), "slots": torch.zeros(key[0], dtype=torch.long)})
    first, second = platform.capture_streams[:2], platform.capture_streams[2:]
    assert first[0] is first[1] and second[0] is second[1] and first[0] is not second[0] and first[0] is not None


def test_eager_outside_the_buckets_and_when_disabled():
    step, calls = _step_calls()
    cache = CudaGraphCache("t", step, _FakeGraphPlatform(), enabled=True, batch_sizes=[1, 2], lengths=[8])
    cache.capture(lambda key: {"x": torch.zeros(key[0]), "slots": torch.zeros(key[0], dtype=torch.long)})
    calls.clear()
    cache.run(5, 4, {"x": torch.ones(5), "slots": torch.zeros(5, dtype=torch.long)}, {})
    cache.run(1, 100, {"x": torch.ones(1), "slots": torch.zeros(1, dtype=torch.long)}, {})
    assert calls == [(5, 4), (1, 100)] and cache.num_eager == 2  # exact shapes, eagerly
    cpu = CudaGraphCache("t", step, Platform("cpu", "cpu", "gloo", False), enabled=True, batch_sizes=[1, 2])
    assert not cpu.enabled  # the CPU never captures
    calls.clear()
    cpu.run(2, 37, {"x": torch.ones(2), "slots": torch.zeros(2, dtype=torch.long)}, {})
    assert calls == [(2, None)]  # no length buckets: the step is not told a length (a compiled one would re-trace)


def test_failed_capture_falls_back_to_eager():
    def broken(length, x):
        raise RuntimeError("not capturable")

    cache = CudaGraphCache("t", broken, _FakeGraphPlatform(), enabled=True, batch_sizes=[1])
    cache.capture(lambda key: {"x": torch.zeros(1)})
    assert not cache.enabled and len(cache) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_eager_on_the_tiny_model():
    import asyncio

    from omnirt.loadtest.gpu_check import main_async

    class Args:
        num_requests, thinker_tokens, frames = 4, 12, 20
        serve_args = ["--model", "tiny", "--dtype", "float32", "--set", "moe_backend=batched_mm"]

    result = asyncio.run(main_async(Args))
    assert result["identical_text"] == 4 and result["thinker_graphs"] > 0 and result["thinker_replays"] > 0
    assert all(graphs and replays for graphs, replays in result["prefill_graphs"].values())  # prefill replayed
