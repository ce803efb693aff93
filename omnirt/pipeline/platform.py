"""The platform shim: which accelerator this process runs on, and the few calls that differ by it.

Detection happens once, at the boundary (`detect_platform`); everything else asks the returned
`Platform` for device names and pinning, synchronisation, memory figures, graph capture, how
tensors cross processes and which collective backend to use. Every device call goes through
`torch.<device_type>` (torch.cuda also serves ROCm; torch.npu is registered by torch_npu), so a
new platform is a new table row, not new branches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from omnirt.pipeline.types import PLATFORMS


@dataclass(slots=True, frozen=True)
class Platform:
    name: str  # one of PLATFORMS
    device_type: str  # torch device type: cuda (also for ROCm), npu, xpu, cpu
    dist_backend: str  # nccl / rccl / hccl / xccl / gloo
    supports_graphs: bool
    visible_devices_env: str | None = None  # how a worker process is pinned to one device
    graph_class: str | None = None  # the graph type on torch.<device_type>
    ipc_transport: str = "shm"  # "cuda_ipc": device tensors may be shared by handle; "shm": staged via host memory

    # ---- devices ----------------------------------------------------------------------------------------

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu") if self.device_type == "cpu" else torch.device(self.device_type, index)

    def device_name(self, index: int = 0) -> str:
        """"cuda:1", "npu:0", "cpu" (a string: torch knows "npu" only once torch_npu is imported)."""
        return "cpu" if self.device_type == "cpu" else f"{self.device_type}:{index}"

    def device_count(self) -> int | None:
        """Devices this process can see; None on the CPU, where device indices only name replicas."""
        return None if self.device_type == "cpu" else self._module().device_count()

    def pin_device(self, index: int) -> None:
        """Make device `index` the only (and so the 0th) device of this process. Call before the first
        device call of a fresh worker process; a no-op on the CPU."""
        if self.visible_devices_env is not None:
            os.environ[self.visible_devices_env] = str(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        if self.device_type != "cpu":
            self._module().synchronize(device)

    # ---- memory -------------------------------------------------------------------------------------

    def memory_allocated(self, device: torch.device | None = None) -> int:
        if self.device_type == "cpu":
            return 0
        return self._module().memory_allocated(device)

    def max_memory_allocated(self, device: torch.device | None = None) -> int:
        """The most allocated at once since the process started (0 on the CPU): what loading the weights needed."""
        if self.device_type == "cpu":
            return 0
        return self._module().max_memory_allocated(device)

    def mem_get_info(self, device: torch.device | None = None) -> tuple[int, int]:
        """(free, total) bytes of the device; on the CPU, of the host: what the kernel counts as available
        (MemAvailable: free plus reclaimable caches) and the physical memory."""
        if self.device_type == "cpu":
            return host_memory()
        return self._module().mem_get_info(device)

    def empty_cache(self) -> None:
        """Hand the caching allocator's free blocks back to the device, so that `mem_get_info` counts them free
        (quantising at load frees the bf16 weights into that cache: 30 GiB on the full-size model)."""
        if self.device_type != "cpu":
            self._module().empty_cache()

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """The figures operators and the KV sizing look at, in bytes (all 0 on the CPU)."""
        if self.device_type == "cpu":
            return {"allocated": 0, "reserved": 0, "free": 0, "total": 0}
        mod = self._module()
        free, total = mod.mem_get_info(device)
        return {"allocated": mod.memory_allocated(device), "reserved": mod.memory_reserved(device),
                "free": free, "total": total}

    def allocator_counters(self) -> dict[str, int]:
        """The caching allocator's counters over the devices this process sees, since it started (empty on the
        CPU): a retry frees every cached block and synchronises the device, and a device allocation
        (cudaMalloc) is slow and may synchronise too, so either while serving stalls every stage thread."""
        if self.device_type == "cpu":
            return {}
        mod, out = self._module(), {"alloc_retries": 0, "device_allocs": 0, "reserved_bytes": 0}
        for index in range(mod.device_count()):
            m = mod.memory_stats(index)
            out["alloc_retries"] += m.get("num_alloc_retries", 0)
            out["device_allocs"] += m.get("num_device_alloc", 0)
            out["reserved_bytes"] += m.get("reserved_bytes.all.current", 0)
        return out

    # ---- graphs ---------------------------------------------------------------------------------------

    def new_graph(self) -> Any:
        """An empty device graph to capture into (torch.cuda.CUDAGraph, torch.npu.NPUGraph, ...)."""
        self._require_graphs()
        return getattr(self._module(), self.graph_class)()

    def graph_context(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """The capture context: `with platform.graph_context(g, pool): step()`; replay with `g.replay()`."""
        self._require_graphs()
        return self._module().graph(graph, pool=pool, stream=stream)

    def graph_pool_handle(self) -> Any:
        self._require_graphs()
        return self._module().graph_pool_handle()

    # ---- streams ------------------------------------------------------------------------------------

    def new_stream(self) -> Any:
        return self._module().Stream()

    def stage_stream(self) -> Any:
        """A stream of its own for a stage thread, so stages overlap on the device; None on the CPU."""
        return self.new_stream() if self.supports_graphs else None

    def current_stream(self) -> Any:
        return self._module().current_stream()

    def stream_context(self, stream: Any) -> Any:
        return self._module().stream(stream)

    def _require_graphs(self) -> None:
        if not self.supports_graphs or self.graph_class is None:
            raise RuntimeError(f"graph capture is not available on {self.name}; run with enforce_eager")

    # ---- distributed --------------------------------------------------------------------------------

    def init_process_group(self, rank: int, world_size: int, init_method: str) -> None:
        """Join a collective group with this platform's backend (nccl/rccl/hccl/xccl/gloo)."""
        import torch.distributed as dist

        backend = "nccl" if self.dist_backend == "rccl" else self.dist_backend  # ROCm's RCCL answers to "nccl"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)

    def _module(self) -> Any:
        return getattr(torch, self.device_type)


_KNOWN = {
    "cuda": Platform("cuda", "cuda", "nccl", True, "CUDA_VISIBLE_DEVICES", "CUDAGraph", "cuda_ipc"),
    "rocm": Platform("rocm", "cuda", "rccl", True, "HIP_VISIBLE_DEVICES", "CUDAGraph", "cuda_ipc"),
    "npu": Platform("npu", "npu", "hccl", False, "ASCEND_RT_VISIBLE_DEVICES", "NPUGraph"),
    "xpu": Platform("xpu", "xpu", "xccl", False, "ZE_AFFINITY_MASK", "XPUGraph"),
    "cpu": Platform("cpu", "cpu", "gloo", False),
}


def get_platform(name: str) -> Platform:
    if name not in _KNOWN:
        raise ValueError(f"unknown platform {name!r}; expected one of {', '.join(PLATFORMS)}")
    return _KNOWN[name]


def detect_platform() -> Platform:
    """The first accelerator torch can see: CUDA (or ROCm under the same API), Ascend NPU, Intel XPU, else CPU."""
    if torch.cuda.is_available():
        return _KNOWN["rocm" if torch.version.hip else "cuda"]
    if hasattr(torch, "npu") and torch.npu.is_available():  # registered by torch_npu
        return _KNOWN["npu"]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return _KNOWN["xpu"]
    return _KNOWN["cpu"]


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from /proc/meminfo where there is one (Linux)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


def set_num_threads(n: int) -> None:
    """torch's intra-op threads for this process (stage threads share them)."""
    torch.set_num_threads(n)
