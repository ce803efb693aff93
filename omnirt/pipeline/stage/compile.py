"""Fused decode steps: the decoder layers compiled by inductor before their graphs are captured.

A decode step of transformers' modules is hundreds of small kernels per layer (norms, rotary, SiLU·mul,
router softmax/top-k, each its own launch); inductor fuses that glue into a few Triton kernels per
layer, and the captured graph replays those. This is regional compilation: each decoder layer is
compiled on its own, and since every layer of a stack runs the same code on parameters of the same
shapes, all of them share one compiled graph per input shape. Compiling whole steps instead took 184 s
for the full-size Thinker alone on the H200 host. Shapes are dynamic (one graph serves every batch
bucket of two rows or more; dynamo specialises a size of 1, so a batch of one compiles once more).
Compilation happens during start-up, in the warm-up runs of the first capture of each shape; a step
whose graphs are captured never reaches the compiler while serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)
# Every transformers decoder layer runs through one wrapper function (gradient checkpointing's), so the
# stacks' layer kinds and their shapes (batch 1 or more, one token or two) share its recompile budget.
RECOMPILE_LIMIT = 64


def compile_layers(layers: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """Each layer compiled (they reuse one another's compiled code: parameters are graph inputs)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # no guard that two sizes are equal because they were at the first call (a batch of 4 rows and the 4 KV heads
    # of a layer's buffers): such a guard fails on the next batch and costs a compile
    torch.fx.experimental._config.use_duck_shape = False
    return [torch.compile(layer, dynamic=True) for layer in layers]


class TimedStep:
    """A step whose layers are compiled: `seconds` sums its calls that compiled something (dynamo traced a
    new graph), for the start-up report."""

    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]]):
        self.name = name
        self.step = fn
        self.seconds = 0.0
        self.num_compiles = 0

    def __call__(self, length: int | None, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        before, started = graphs_compiled(), time.perf_counter()
        out = self.step(length, **tensors)
        if (new := graphs_compiled() - before) > 0:
            elapsed = time.perf_counter() - started
            self.num_compiles += new
            self.seconds += elapsed
            log.info("%s: compiled %d graph(s) in %.1f s (batch %d)", self.name, new, elapsed,
                     next(iter(tensors.values())).shape[0])
        return out


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process (any function)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def step_function(name: str, fn: Callable[..., tuple[torch.Tensor, ...]], compiled: bool):
    """The step as it runs: timed where its layers are compiled, else as written."""
    return TimedStep(name, fn) if compiled else fn
