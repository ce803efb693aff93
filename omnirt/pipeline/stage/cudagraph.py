"""Capture and replay of fixed-shape steps, one graph per shape bucket.

A step function `fn(length, **tensors)` takes tensors whose shapes are fixed by its bucket key (batch size,
and a length such as the KV length where the step needs one; the batch is each tensor's first dimension);
callers pad their inputs to the bucket (scratch slot, position 0, token 0) and slice the outputs. Graphs
are captured largest first into one shared memory pool, each after a warm-up run. Outside the buckets, or
with graphs off (`enforce_eager`, CPU), the function runs eagerly. With `compile_step` the step's layers
are compiled (`omnirt/pipeline/stage/compile.py`): that happens in the first warm-ups, and the graphs replay the fused
kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.compile import TimedStep, step_function

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `n`, or None when `n` is past the largest."""
    return next((b for b in buckets if b >= n), None)


def batch_buckets(max_batch: int) -> list[int]:
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


def length_buckets(max_len: int, smallest: int = 128) -> list[int]:
    """Powers of two from `smallest` up to (and including) `max_len`."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


@dataclass(slots=True)
class _Captured:
    graph: object
    inputs: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


class CudaGraphCache:
    """Graphs of one step function, keyed by (batch bucket, length bucket or None)."""

    def __init__(self, name: str, fn: Callable[..., tuple[torch.Tensor, ...]], platform: Platform, enabled: bool,
                 batch_sizes: Sequence[int], lengths: Sequence[int] | None = None, compile_step: bool = False,
                 max_cells: int | None = None):
        """`fn(length, **tensors)` returns a tuple of tensors; (batch, length) fixes every shape. `max_cells`:
        only the keys whose batch x length is at most that get a graph (prefill steps: the tokens of a chunk)."""
        self.name, self.platform = name, platform
        self.fn = step_function(name, fn, compile_step)
        self.enabled = enabled and platform.supports_graphs
        self.batch_sizes, self.lengths = list(batch_sizes), None if lengths is None else list(lengths)
        self.max_cells = max_cells
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = None
        self.num_replays = self.num_eager = 0

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def keys(self) -> list[tuple[int, int | None]]:
        return [(b, n) for b in self.batch_sizes for n in (self.lengths or [None])
                if self.max_cells is None or n is None or b * n <= self.max_cells]

    def capture(self, make_inputs: Callable[[Hashable], dict[str, torch.Tensor]]) -> None:
        """Capture one graph per key, largest first (the first capture sizes the shared pool). A step
        that cannot be captured runs eagerly, with a warning, rather than failing the start."""
        if not self.enabled:
            return
        try:
            with torch.inference_mode():  # no autograd state may hang off the captured outputs
                self._capture_all(make_inputs)
        except Exception:
            log.exception("%s: graph capture failed; this step runs eagerly", self.name)
            self._graphs.clear()
            self.enabled = False

    def _capture_all(self, make_inputs: Callable[[Hashable], dict[str, torch.Tensor]]) -> None:
        from tqdm import tqdm

        # A capture stream of this cache's own: library workspaces (cuBLAS) are keyed by stream, and graphs of
        # two stages replayed at once on their stage streams must not share one (a race that hung the H200).
        stream = self.platform.new_stream()
        for key in tqdm(sorted(self.keys, reverse=True), desc=f"capturing {self.name} graphs", unit="graph"):
            inputs = make_inputs(key)
            stream.wait_stream(self.platform.current_stream())
            with self.platform.stream_context(stream):
                for _ in range(2):  # warm-up: compilation, lazy init, autotuning, allocator
                    self.fn(key[1], **inputs)
            self.platform.current_stream().wait_stream(stream)
            graph = self.platform.new_graph()
            if self._pool is None:
                self._pool = self.platform.graph_pool_handle()
            with self.platform.graph_context(graph, self._pool, stream):
                outputs = self.fn(key[1], **inputs)
            self._graphs[key] = _Captured(graph, inputs, outputs)
        self.platform.synchronize()
        if isinstance(self.fn, TimedStep):
            log.info("%s: %d graphs of the compiled layers (%d compilations, %.1f s)", self.name, len(self._graphs),
                     self.fn.num_compiles, self.fn.seconds)

    def length_bucket(self, length: int) -> int | None:
        """The captured length that holds `length` (None when graphs are off or it is too long): a
        caller whose inputs carry the length dimension pads them to it."""
        if not self.enabled or not self.lengths:
            return None
        return bucket_for(length, self.lengths)

    def holds(self, n: int, length: int | None) -> bool:
        """Whether `n` rows needing `length` replay a captured graph (else `run` runs the step eagerly)."""
        return self.enabled and self._key(n, length) in self._graphs

    def _key(self, n: int, length: int | None) -> tuple[int | None, int | None]:
        size = None if self.lengths is None or length is None else bucket_for(length, self.lengths)
        return bucket_for(n, self.batch_sizes), size

    def run(self, n: int, length: int | None, inputs: dict[str, torch.Tensor],
            pads: dict[str, int]) -> tuple[torch.Tensor, ...]:
        """Run the step for `n` rows needing `length`: replay the smallest bucket that holds them, with
        rows padded by `pads` (e.g. the scratch slot), or run eagerly at the exact shape."""
        captured = self._graphs.get(self._key(n, length)) if self.enabled else None
        if captured is None:
            self.num_eager += 1  # a step without length buckets needs no length (nor a recompile per value)
            return self.fn(None if self.lengths is None else length, **inputs)
        for name, value in inputs.items():
            static = captured.inputs[name]
            static[:n].copy_(value, non_blocking=True)
            static[n:].fill_(pads.get(name, 0))
        captured.graph.replay()
        self.num_replays += 1
        return tuple(out[:n] for out in captured.outputs)
