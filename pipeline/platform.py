"""The platform shim: which accelerator this process runs on, and the few calls that differ by it.

Detection happens once, at the boundary (`detect_platform`); everything else asks the returned
`Platform` for device names, synchronisation, memory figures and whether graphs can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLATFORMS = ("cuda", "rocm", "npu", "xpu", "cpu")


@dataclass(slots=True, frozen=True)
class Platform:
    name: str  # one of PLATFORMS
    device_type: str  # torch device type: cuda (also for ROCm), npu, xpu, cpu
    dist_backend: str  # nccl / rccl / hccl / xccl / gloo
    supports_graphs: bool

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu") if self.device_type == "cpu" else torch.device(self.device_type, index)

    def synchronize(self, device: torch.device | None = None) -> None:
        if self.device_type != "cpu":
            getattr(torch, self.device_type).synchronize(device)

    def memory_allocated(self, device: torch.device | None = None) -> int:
        if self.device_type == "cpu":
            return 0
        return getattr(torch, self.device_type).memory_allocated(device)

    # ---- graphs and streams: only where supports_graphs (CUDA and ROCm share torch.cuda) ----

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def graph_context(self, graph, pool):
        return torch.cuda.graph(graph, pool=pool)

    def new_stream(self):
        return torch.cuda.Stream()

    def stage_stream(self):
        """A stream of its own for a stage thread, so stages overlap on the device; None on the CPU."""
        return self.new_stream() if self.supports_graphs else None

    def current_stream(self):
        return torch.cuda.current_stream()

    def stream_context(self, stream):
        return torch.cuda.stream(stream)

    def mem_get_info(self, device: torch.device | None = None) -> tuple[int, int]:
        """(free, total) bytes of the device; (0, 0) on the CPU."""
        if self.device_type == "cpu":
            return 0, 0
        return getattr(torch, self.device_type).mem_get_info(device)


_KNOWN = {
    "cuda": Platform("cuda", "cuda", "nccl", supports_graphs=True),
    "rocm": Platform("rocm", "cuda", "rccl", supports_graphs=True),
    "npu": Platform("npu", "npu", "hccl", supports_graphs=False),
    "xpu": Platform("xpu", "xpu", "xccl", supports_graphs=False),
    "cpu": Platform("cpu", "cpu", "gloo", supports_graphs=False),
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
