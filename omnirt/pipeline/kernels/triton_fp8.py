"""The Triton kernel behind `omnirt.pipeline.kernels.fp8.fp8_linear`: y = x @ (W x scales)^T for FP8 weights W [N, K]
with one float32 scale per SCALE_BLOCK x SCALE_BLOCK block, x [M, K] in the activations' dtype.

Program (row tile, column tile) walks the reduction in tiles of BLOCK_K (which divides SCALE_BLOCK, so a tile lies
in one scale block): it widens the weight tile to x's dtype, multiplies, and scales each column of the product by
its block's scale in the fp32 accumulator. A decode step's M is small: the kernel is bound by reading W once.

`widen_kernel` writes FP8 weights out in a wider dtype, for calls with many rows (prefill chunks), which cuBLAS and
grouped_mm then take at full matrix rate.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def fp8_linear_kernel(X, W, S, Bias, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SCALE_BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        scale = tl.load(S + (n // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def widen_kernel(Q, S, Out, N, K, stride_qe, stride_se, stride_sn, SCALE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Program (matrix e, row tile, column tile) of FP8 weights Q [E, N, K] (rows contiguous): each value times its
    block's scale in fp32, stored once in Out's dtype."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    at = e * stride_qe + n[:, None] * K + k[None, :]
    scale = tl.load(S + e * stride_se + (n // SCALE_BLOCK)[:, None] * stride_sn + (k // SCALE_BLOCK)[None, :], mask=ok,
                    other=0.0)
    w = tl.load(Q + at, mask=ok, other=0.0).to(tl.float32) * scale
    tl.store(Out + at, w.to(Out.dtype.element_ty), mask=ok)
