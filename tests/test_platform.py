"""The platform shim. Only the CPU runs here; CUDA, ROCm, NPU and XPU are checked with the device
module faked at the boundary the shim calls (`torch.<device_type>`), which proves the dispatch
and the per-platform values, not the devices themselves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omnirt.pipeline.platform import PLATFORMS, detect_platform, get_platform

ROOT = Path(__file__).resolve().parents[1]


class FakeDeviceModule:
    """Stands in for torch.cuda / torch.npu / torch.xpu: fixed figures, and a log of the calls."""

    def __init__(self):
        self.calls: list[str] = []
        self.available = True

    def is_available(self):
        return self.available

    def device_count(self):
        return 4

    def synchronize(self, device=None):
        self.calls.append("synchronize")

    def memory_allocated(self, device=None):
        return 10

    def memory_reserved(self, device=None):
        return 20

    def mem_get_info(self, device=None):
        return 30, 40

    def empty_cache(self):
        self.calls.append("empty_cache")

    def graph_pool_handle(self):
        self.calls.append("graph_pool_handle")
        return "pool"

    def graph(self, graph, pool=None, stream=None):
        import contextlib

        assert pool == "pool" and graph == "graph"
        self.calls.append("graph")
        return contextlib.nullcontext()

    def Stream(self):  # noqa: N802 (torch's name)
        self.calls.append("Stream")
        return "stream"

    def stream(self, stream):
        import contextlib

        assert stream == "stream"
        self.calls.append("stream")
        return contextlib.nullcontext()

    def __getattr__(self, name):  # CUDAGraph / NPUGraph / XPUGraph
        if name.endswith("Graph"):
            self.calls.append("graph_class")
            return lambda: "graph"
        raise AttributeError(name)


@pytest.fixture
def fake_device(monkeypatch):
    """Install a recording fake as torch.cuda / torch.npu / torch.xpu for one test."""
    def install(device_type: str) -> FakeDeviceModule:
        fake = FakeDeviceModule()
        monkeypatch.setattr(torch, device_type, fake, raising=False)
        return fake
    return install


@pytest.mark.parametrize("name,device_type,backend,env,graph", [
    ("cuda", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", True),
    ("rocm", "cuda", "rccl", "HIP_VISIBLE_DEVICES", True),
    ("npu", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", False),
    ("xpu", "xpu", "xccl", "ZE_AFFINITY_MASK", False),
])
def test_accelerator_platforms_dispatch_to_their_device_module(name, device_type, backend, env, graph, fake_device,
                                                               monkeypatch):
    fake = fake_device(device_type)
    p = get_platform(name)
    assert p.dist_backend == backend and p.device_name(1) == f"{device_type}:1"
    assert p.device_count() == 4
    p.synchronize()
    assert p.memory_stats() == {"allocated": 10, "reserved": 20, "free": 30, "total": 40}
    assert p.mem_get_info() == (30, 40) and p.memory_allocated() == 10
    monkeypatch.delenv(env, raising=False)
    p.pin_device(2)
    assert os.environ[env] == "2"
    monkeypatch.delenv(env)
    if graph:
        g = p.new_graph()
        with p.graph_context(g, pool=p.graph_pool_handle()):
            pass
        with p.stream_context(p.stage_stream()):
            pass
        assert fake.calls == ["synchronize", "graph_class", "graph_pool_handle", "graph", "Stream", "stream"]
    else:
        with pytest.raises(RuntimeError, match=f"graph capture is not available on {name}"):
            p.new_graph()
        assert p.stage_stream() is None  # no per-stage streams where graphs are off
    assert p.ipc_transport == ("cuda_ipc" if device_type == "cuda" else "shm")


def test_cpu_platform_runs_where_no_accelerator_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU machine of `make test-gpu` too
    p = get_platform("cpu")
    assert detect_platform() is p
    assert p.device(3) == torch.device("cpu") and p.device_count() is None
    p.synchronize()
    before = dict(os.environ)
    p.pin_device(1)  # nothing to pin: every replica process uses the CPU
    assert dict(os.environ) == before
    assert p.memory_stats()["total"] == 0
    with pytest.raises(RuntimeError, match="enforce_eager"):
        p.graph_pool_handle()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_platform_is_detected_and_runs_here():
    p = detect_platform()
    assert p is get_platform("rocm" if torch.version.hip else "cuda") and p.device_count() == torch.cuda.device_count()
    free, total = p.mem_get_info()
    assert 0 < free <= total and p.memory_stats()["total"] == total
    p.synchronize()


def test_cpu_distributed_backend_is_real_gloo(tmp_path):
    import torch.distributed as dist

    get_platform("cpu").init_process_group(0, 1, f"file://{tmp_path / 'rendezvous'}")
    try:
        assert dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("found", PLATFORMS)
def test_detection_picks_the_platform_torch_reports(found, fake_device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: found in ("cuda", "rocm"))
    monkeypatch.setattr(torch.version, "hip", "6.2" if found == "rocm" else None)
    for device_type in ("npu", "xpu"):
        fake_device(device_type).available = found == device_type
    assert detect_platform().name == found


class RoomyDevice(FakeDeviceModule):
    def mem_get_info(self, device=None):
        self.calls.append("mem_get_info")
        return 48 * 2**30, 64 * 2**30


@pytest.mark.parametrize("name", PLATFORMS)
def test_the_memory_plan_reads_each_platforms_memory(name, monkeypatch, reference_model):
    """The KV plan is sized from torch.<device_type>.mem_get_info, on the CPU from the host's memory, once the
    caching allocator has handed back what it holds free (quantising at load frees the bf16 weights into it: 30 GiB
    on an H100 that the device would count as used); graph platforms reserve a graph pool for each stage that
    captures."""
    from omnirt.pipeline.models.qwen3_omni.memory import GRAPH_POOL_BYTES
    from omnirt.pipeline.models.qwen3_omni.models import memory_plan
    from omnirt.pipeline.models.qwen3_omni.stages import STAGES
    from omnirt.pipeline.stage.memory_plan import GIB
    from tests.profiles import load_profile

    p = get_platform(name)
    if p.device_type == "cpu":
        monkeypatch.setattr("omnirt.pipeline.platform.host_memory", lambda: (48 * GIB, 64 * GIB))
    else:
        monkeypatch.setattr(torch, p.device_type, device := RoomyDevice(), raising=False)
    cfg = load_profile(ROOT / "omnirt" / "deploy" / "tiny.yaml", name, {"gpu_memory_utilization": 0.5})
    plan = memory_plan(reference_model, cfg, tuple(s.name for s in STAGES), p)
    if p.device_type != "cpu":
        assert device.calls[:2] == ["empty_cache", "mem_get_info"]
    assert plan.device == p.device_name(0) and (plan.free_bytes, plan.total_bytes) == (48 * GIB, 64 * GIB)
    for stage in plan.stages:
        graphs = p.supports_graphs and not cfg.stage(stage.name).enforce_eager
        assert (stage.workspace_bytes > GRAPH_POOL_BYTES) == graphs, stage
    assert plan.num_slots["thinker"] == plan.num_slots["talker"] == 4 * cfg.stage("thinker").max_num_seqs


def test_cpu_memory_is_the_hosts():
    free, total = get_platform("cpu").mem_get_info()
    assert 0 < free <= total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
