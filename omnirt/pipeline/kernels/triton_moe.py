"""The Triton kernels behind `omnirt.pipeline.kernels.moe.fused_experts`: align the (token, expert) pairs, then two
grouped GEMMs over blocks of BLOCK_M pairs that share one expert.

A pair is `token * top_k + k`. `align_kernel` (one program) writes `SortedIds`: each expert's pairs in
pair order, its region padded to a multiple of BLOCK_M with the sentinel `num_pairs`, experts one
after another; `BlockExpert`: the expert of each block; `NumPost`: the padded total. Every buffer has
its worst-case size, so nothing on the host depends on the routing and the whole thing captures in a
CUDA graph; GEMM programs past `NumPost` return at once.

`gate_up_kernel`: program (block, column tile) multiplies its pairs' hidden rows by the expert's gate
and up rows of that tile and writes SiLU(gate) * up (fp32 until the store) to row `block * BLOCK_M + i`
of the intermediate buffer (padding rows get zeros). `down_kernel`: the down projection of those rows,
times each pair's routing weight, stored at row `pair` of the output; the caller sums over top-k.
Weights are read through strides, so [E, N, K] and transposed [E, K, N] layouts both work. FP8 weights
(`omnirt.pipeline.kernels.fp8`) come with `S`, their float32 scales [E, N / SCALE_BLOCK, K / SCALE_BLOCK]: each tile
is widened to the activations' dtype and its product scaled per output column in the accumulator (BLOCK_K divides
SCALE_BLOCK, so a tile's reduction lies in one scale block). SCALE_BLOCK 0: unscaled weights (`S` unread).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])  # one variant for every batch
def align_kernel(TopkIds, SortedIds, BlockExpert, NumPost, num_pairs, num_blocks,
                 NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """NUM_EXPERTS: the expert count rounded up to a power of two (the extra experts get no pairs)."""
    e = tl.arange(0, NUM_EXPERTS)
    counts = tl.zeros([NUM_EXPERTS], tl.int32)
    for s0 in range(0, num_pairs, CHUNK):  # pairs per expert
        s = s0 + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + s, mask=s < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(NumPost, tl.sum(padded, axis=0))
    seen = tl.zeros([NUM_EXPERTS], tl.int32)
    for s0 in range(0, num_pairs, CHUNK):  # each pair's row: its expert's start + earlier pairs of that expert
        s = s0 + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + s, mask=s < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)
        row = tl.sum(hit * (starts[None, :] + seen[None, :] + tl.cumsum(hit, axis=0) - 1), axis=1)
        tl.store(SortedIds + row, s, mask=s < num_pairs)
        seen += tl.sum(hit, axis=0)
    pad = starts[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # each expert's last block
    tl.store(SortedIds + pad, num_pairs, mask=pad < ends[:, None])
    for b0 in range(0, num_blocks, CHUNK):  # a block's expert: how many experts end at or before it
        b = b0 + tl.arange(0, CHUNK)
        expert = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(BlockExpert + b, expert, mask=b < num_blocks)


@triton.jit
def _block_pairs(SortedIds, num_pairs, BLOCK_M: tl.constexpr):
    """This program's rows in the sorted order, their pair ids and which are real (not padding)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedIds + rows)
    return rows, pairs, pairs < num_pairs


@triton.jit
def _scaled_dot(a, w, s_base, n, k0, n_ok, stride_sn, stride_sk, PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """a @ w in fp32; with SCALE_BLOCK, w is fp8: widened to a's dtype, the product scaled by each column's block
    scale at reduction offset k0."""
    if SCALE_BLOCK == 0:
        return tl.dot(a, w, input_precision=PRECISION)
    scale = tl.load(s_base + (n // SCALE_BLOCK) * stride_sn + (k0 // SCALE_BLOCK) * stride_sk, mask=n_ok, other=0.0)
    return tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]


@triton.jit(do_not_specialize=["num_pairs"])
def gate_up_kernel(X, W, S, Out, SortedIds, BlockExpert, NumPost, num_pairs, inter, hidden,
                   stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    if tl.program_id(0) * BLOCK_M >= tl.load(NumPost):
        return
    rows, pairs, real = _block_pairs(SortedIds, num_pairs, BLOCK_M)
    tokens = pairs // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    expert = tl.load(BlockExpert + tl.program_id(0)).to(tl.int64)
    w_base, s_base = W + expert * stride_we, S + expert * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(X + tokens[:, None] * stride_xm + k[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (n + inter)[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        gate += _scaled_dot(x, w_gate, s_base, n, k0, n_ok, stride_sn, stride_sk, PRECISION, SCALE_BLOCK)
        up += _scaled_dot(x, w_up, s_base, n + inter, k0, n_ok, stride_sn, stride_sk, PRECISION, SCALE_BLOCK)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + rows[:, None] * stride_om + n[None, :], act.to(Out.dtype.element_ty), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def down_kernel(A, W, S, Out, SortedIds, BlockExpert, NumPost, RoutingWeights, num_pairs, hidden, inter,
                stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                SCALE_BLOCK: tl.constexpr):
    if tl.program_id(0) * BLOCK_M >= tl.load(NumPost):
        return
    rows, pairs, real = _block_pairs(SortedIds, num_pairs, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    expert = tl.load(BlockExpert + tl.program_id(0)).to(tl.int64)
    w_base, s_base = W + expert * stride_we, S + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc += _scaled_dot(a, w, s_base, n, k0, n_ok, stride_sn, stride_sk, PRECISION, SCALE_BLOCK)
    acc *= tl.load(RoutingWeights + pairs, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(Out + pairs[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
             mask=real[:, None] & n_ok[None, :])
