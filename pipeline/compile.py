"""Fused decode steps: `torch.compile` a step function before its graphs are captured (as vLLM compiles,
then captures per batch bucket).

A decode step of transformers' modules is hundreds of small kernels per layer (norms, rotary, SiLU·mul,
router softmax/top-k, sampling glue, each its own launch); inductor fuses that glue into a few Triton
kernels per layer, and the captured graph replays those. The batch dimension of every input is marked
dynamic, so one compilation serves every batch bucket of two rows or more, and one more (dynamo
specialises a size of 1) the batch of one. Compilation happens during start-up, in the warm-up runs of
the first capture of each; a step whose graphs are captured never reaches the compiler while serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class CompiledStep:
    """`fn(length, **tensors)` compiled by inductor, with the batch dimension (dim 0 of every tensor) dynamic.
    `seconds` sums the calls that compiled (dynamo traced a new graph), for the start-up report."""

    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.name = name
        self.seconds = 0.0
        self.num_compiles = 0
        self.step = fn  # as written
        self._fn = torch.compile(fn, fullgraph=False)

    def __call__(self, length: int | None, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for t in tensors.values():
            torch._dynamo.mark_dynamic(t, 0)
        before = _graphs_compiled()
        started = time.perf_counter()
        out = self._fn(length, **tensors)
        if _graphs_compiled() != before:
            self.num_compiles += 1
            self.seconds += time.perf_counter() - started
            log.info("%s: compiled in %.1f s (at batch %d)", self.name, time.perf_counter() - started,
                     next(iter(tensors.values())).shape[0])
        return out


def _graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (any function)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def step_function(name: str, fn: Callable[..., tuple[torch.Tensor, ...]], compile_step: bool):
    """The step as it runs: compiled (fused) or as written."""
    return CompiledStep(name, fn) if compile_step else fn
