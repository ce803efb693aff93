"""Drive a transformers decoder stack (its own layers, norms and rotary tables) over a slot cache.

The layers are transformers' modules, so the numerics are the reference's; only the cache and the
position bookkeeping are ours. Batches are padded [B, T] with per-row starts and lengths.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from omnirt.pipeline.platform import Platform
from omnirt.pipeline.stage.compile import graphs_compiled
from omnirt.pipeline.stage.cudagraph import CudaGraphCache
from omnirt.pipeline.stage.kv_cache import CacheView, SlotKVCache
from omnirt.pipeline.stage.pinned import PinnedBuffers

log = logging.getLogger(__name__)
MIN_COMPILED = 2  # rows and tokens a compiled prefill pads to
WARM_ROWS = 4  # not a length of the warm-ups: no size equals another by chance
WARM_LENGTHS = (5, 2, 3, 9, 17, 33)  # t x (query heads per KV head) reaches each block size of the slot attention
WARM_LONG = 512  # x WARM_ROWS x top-k (2 or more) routed pairs: past the fused MoE's limit of 2048
POWERS = tuple(2 ** i for i in range(1, 15))
PREFILL_ROWS = tuple(sorted(POWERS + (24, 48)))  # the rows of prefill graphs: 40 rows pad to 48, not 64
PREFILL_WIDTHS = tuple(sorted(POWERS + (96, 192, 384, 768, 1536, 3072, 6144)))  # widths: 142 tokens pad to 192


def run_decoder(stack: torch.nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor, view: CacheView,
                tap_layer: int | None = None, layers: Sequence[torch.nn.Module] | None = None,
                deepstack: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (final normed hidden [B,T,H], hidden after `tap_layer` layers or None).

    `tap_layer` counts like transformers' `hidden_states` tuple: 0 is the embeddings, k the output of
    layer k, and the last index the normed output. `layers`: the stack's layers as they run (compiled
    ones, `omnirt/pipeline/stage/compile.py`), by default the stack's own. `deepstack` [L, B, T, H]: added to the output
    of each of the first L layers (Qwen3's deepstack visual rows, zero off the image positions), after the
    tap reads it, as transformers records a layer's output before its `_deepstack_process`.
    """
    position_embeddings = stack.rotary_emb(embeds, position_ids)
    hidden, tapped = embeds, embeds if tap_layer == 0 else None
    num_layers = len(stack.layers)
    for i, layer in enumerate(layers or stack.layers):
        view.select_layer(i)  # the layer's buffers as tensors: a compiled layer then serves every layer
        hidden = layer(hidden, attention_mask=view.mask, cache=view, position_embeddings=position_embeddings)
        if tap_layer == i + 1 and tap_layer < num_layers:
            tapped = hidden
        if deepstack is not None and i < len(deepstack):
            hidden = hidden + deepstack[i]
    normed = stack.norm(hidden)
    if tap_layer == num_layers:
        tapped = normed
    return normed, tapped


@contextlib.contextmanager
def experts_implementation(stack: torch.nn.Module, name: str | None):
    """Run a MoE stack with another transformers experts implementation for a while: batched_mm inside
    captured decode graphs when grouped_mm cannot be captured (outside bf16 its fallback reads the group
    sizes on the host), grouped_mm for everything else (it reads each active expert once)."""
    config = stack.config
    saved = config._experts_implementation
    if name is not None:
        config._experts_implementation = name
    try:
        yield
    finally:
        config._experts_implementation = saved


def last_rows(hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The hidden state of each row's last valid position: [B, H] (`lengths` on the device, as a step's
    `CacheView` holds them: no host copy)."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]


def pad_rows(rows: list[torch.Tensor], num_rows: int = 0, width: int = 0) -> torch.Tensor:
    """Right-pad a list of [T_i, ...] tensors into [max(B, num_rows), max(T_max, width), ...] (zeros)."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    more_rows, more_cols = max(0, num_rows - out.shape[0]), max(0, width - out.shape[1])
    if more_rows or more_cols:
        out = torch.nn.functional.pad(out, (0, 0) * (out.dim() - 2) + (0, more_cols, 0, more_rows))
    return out


class PrefillPass:
    """The prefill chunks of one decoder stack: padded into one [B, T] batch over the slot cache.

    Where the stack's decode layers are compiled (`omnirt/pipeline/stage/compile.py`), prefill runs their compiled code
    too, warmed at start-up for its shapes (`warm_up`), but never compiles while serving: dynamo's run-only
    mode runs what was compiled and anything else eagerly, so a shape no warm-up covered costs the eager
    pass (as without compilation), not a compile that holds the interpreter lock for seconds. Compiled, a
    batch pads to at least `MIN_COMPILED` rows and tokens: dynamo specialises a size of 1, which would need
    compiles of its own (the batch, the chunk, and the count of tokens written). A padding row is one token
    written to the scratch slot.

    With graphs (a stage whose decode steps are captured, attention in place), a chunk batch of at most
    `max_tokens` padded tokens replays a graph captured at start-up for its (rows, width) bucket
    (`prefill_buckets`). Issuing the layers one by one cost the host ~2 ms per compiled layer (the inductor
    wrapper, the custom ops' Python, dynamo's guards): 107 ms for a Thinker step whose kernels took 7 ms on an
    H200. Chunks with image rows (deepstack) and larger batches run as above.
    """

    def __init__(self, name: str, stack: torch.nn.Module, kv: SlotKVCache, compiled: Sequence[torch.nn.Module] | None,
                 platform: Platform, graphs: bool = False, max_rows: int = 1, max_tokens: int = 0,
                 tap_layer: int | None = None):
        self.name, self.stack, self.kv, self.compiled, self.tap_layer = name, stack, kv, compiled, tap_layer
        self.warm_kernels = platform.supports_graphs  # Triton compiles its kernels here (a device, not the interpreter)
        self.layers = None if compiled is None else [torch._dynamo.run(layer) for layer in compiled]
        rows, widths = prefill_buckets(max_rows, kv.max_len, max_tokens)
        self.cuda_graphs = CudaGraphCache(f"{name} prefill", self._graph_step, platform,
                                          graphs and kv.in_place and bool(rows), rows, widths, compiled is not None,
                                          max_cells=max_tokens)
        self.pinned = PinnedBuffers(kv.k.device)

    def run(self, reqs, starts: list[int], lengths: list[int], rows: str,
            deepstack_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the final normed row of each chunk's last token [B, H], the `tap_layer` rows [B, T, H] or None) for
        chunks [starts[i], starts[i] + lengths[i]) of stage requests whose state holds the prompt's rows as
        `state.<rows>` [P, H] and its positions as `state.position_ids` [3, P]. `deepstack_of(embeds)`: the rows
        the first layers add (`run_decoder`), for the padded batch (never through a graph)."""
        if deepstack_of is None and self.cuda_graphs.holds(len(reqs), max(lengths)):
            width = self.cuda_graphs.length_bucket(max(lengths))
            out = self.cuda_graphs.run(len(reqs), width, self.graph_inputs(reqs, starts, lengths, rows, width),
                                  {"slots": self.kv.scratch_slot})
            return out[0], out[1] if len(out) > 1 else None
        embeds, pos, view = self.of_requests(reqs, starts, lengths, rows)
        deepstack = None if deepstack_of is None else deepstack_of(embeds)
        normed, tapped = run_decoder(self.stack, embeds, pos, view, self.tap_layer, self.layers, deepstack)
        return last_rows(normed, view.lengths), tapped

    def graph_inputs(self, reqs, starts: list[int], lengths: list[int], rows: str, width: int
                     ) -> dict[str, torch.Tensor]:
        """The chunks as a graph of `width` takes them (rows not yet padded to its bucket): embeds [B, width, H],
        positions [B, width, 3] (the batch first, as `CudaGraphCache` pads it), slots, starts, lengths [B]."""
        chunk_rows, positions = _chunks(reqs, starts, lengths, rows)
        embeds = pad_rows(chunk_rows, width=width)
        pos = pad_rows([p.T for p in positions], width=width)
        slots, t_starts, t_lengths = self.pinned.tensors([r.slot for r in reqs], starts, lengths)
        return {"embeds": embeds, "positions": pos, "slots": slots, "starts": t_starts, "lengths": t_lengths}

    def _graph_step(self, _width, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fixed-shape prefill step graphs capture: padding rows have length 0, padding tokens write to the
        scratch slot (`SlotKVCache.padded_view`)."""
        view = self.kv.padded_view(slots, starts, lengths, embeds.shape[1])
        normed, tapped = run_decoder(self.stack, embeds, positions.permute(2, 0, 1), view, self.tap_layer,
                                     self.compiled)
        last = last_rows(normed, lengths.clamp(min=1))
        return (last,) if tapped is None else (last, tapped)

    def capture(self, graph_moe: str | None) -> None:
        """The prefill graphs, after `warm_up` (their warm-up runs compile what the buckets' shapes still need)."""
        hidden, dtype, device = self.stack.config.hidden_size, self.stack.dtype, self.kv.k.device

        def inputs(key):
            b, width = key
            zeros = torch.zeros(b, dtype=torch.long, device=device)
            return {"embeds": torch.zeros(b, width, hidden, dtype=dtype, device=device),
                    "positions": torch.arange(width, device=device)[None, :, None].expand(b, width, 3).contiguous(),
                    "slots": zeros + self.kv.scratch_slot, "starts": zeros.clone(), "lengths": zeros + width}

        with experts_implementation(self.stack, graph_moe):
            self.cuda_graphs.capture(inputs)

    def inputs(self, slots: list[int], starts: list[int], lengths: list[int], rows: list[torch.Tensor],
               positions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, CacheView]:
        """(embeds [B, T, H], positions [3, B, T], the cache view) of rows [T_i, H] and positions [3, T_i]."""
        least = MIN_COMPILED if self.layers is not None else 1
        extra, width = max(0, least - len(slots)), max(least, *lengths)
        embeds = pad_rows(rows, len(slots) + extra, width)
        pos = pad_rows([p.T for p in positions], len(slots) + extra, width).permute(2, 0, 1)
        view = self.kv.view(slots + [self.kv.scratch_slot] * extra, starts + [0] * extra, lengths + [1] * extra,
                            width)
        return embeds, pos, view

    def of_requests(self, reqs, starts: list[int], lengths: list[int], rows: str
                    ) -> tuple[torch.Tensor, torch.Tensor, CacheView]:
        """`inputs` of the chunks `run` takes."""
        return self.inputs([r.slot for r in reqs], starts, lengths, *_chunks(reqs, starts, lengths, rows))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the prefill shapes (a short chunk, one long enough for the MoE's long-chunk path) and run chunk
        lengths that reach each variant of the Triton kernels (the slot attention's block sizes), so that
        neither compiles while serving (the first request on a fresh server waited 0.5 s for them). Writes go
        to the scratch slot."""
        if self.compiled is None and not self.warm_kernels:
            return
        from tqdm import tqdm

        hidden, dtype = self.stack.config.hidden_size, self.stack.dtype
        device, before = self.kv.k.device, graphs_compiled()
        lengths = (WARM_LENGTHS[0], min(self.kv.max_len, WARM_LONG), *WARM_LENGTHS[1:])
        for t in tqdm(lengths, desc=f"warming {self.name} prefill", unit="shape"):
            rows = [torch.zeros(t, hidden, dtype=dtype, device=device)] * WARM_ROWS
            embeds, pos, view = self.inputs([self.kv.scratch_slot] * WARM_ROWS, [0] * WARM_ROWS, [t] * WARM_ROWS,
                                            rows, [torch.arange(t, device=device).expand(3, -1)] * WARM_ROWS)
            run_decoder(self.stack, embeds, pos, view, layers=self.compiled)
        log.info("%s prefill: %d graph(s) of the compiled layers for chunks of %s tokens", self.name,
                 graphs_compiled() - before, lengths)


def _chunks(reqs, starts: list[int], lengths: list[int], rows: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each chunk's rows [n, H] (`state.<rows>`) and positions [3, n] (`state.position_ids`)."""
    chunks = list(zip(reqs, starts, lengths, strict=True))
    return ([getattr(r.state, rows)[s:s + n] for r, s, n in chunks],
            [r.state.position_ids[:, s:s + n] for r, s, n in chunks])


def prefill_buckets(max_rows: int, max_len: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """(row buckets, width buckets) of prefill graphs: powers of two from 2 (dynamo specialises a size of 1) with
    1.5x steps between the larger ones (a chunk batch padded to the next power of two did up to twice the work:
    29 rows x 142 tokens ran as 32 x 256), up to `max_rows` rows (itself the last bucket) and `max_len` tokens; a
    graph's rows x width is at most `max_tokens` (`CudaGraphCache`'s `max_cells`). None when `max_tokens` holds no
    2 x 2 batch."""
    if max_tokens < MIN_COMPILED * MIN_COMPILED:
        return [], []
    rows = [b for b in PREFILL_ROWS if b < max_rows] + [max(MIN_COMPILED, max_rows)]
    widths = [w for w in PREFILL_WIDTHS if w < max_len and w * MIN_COMPILED <= max_tokens]
    return rows, widths + ([max_len] if max_len * MIN_COMPILED <= max_tokens else [])
