"""The Triton kernels behind `snake_conv.py`: a causal stride-1 Conv1d as an implicit GEMM whose epilogue
adds the bias, applies the SnakeBeta that follows the convolution and adds a residual, before its one store;
and SnakeBeta alone, one read and one write.

`conv_kernel`: program (time tile, output-channel tile, batch row) computes
out[b, co, t] = act(bias[co] + sum over taps k and input channels ci of W[k, co, ci] * x[b, ci, t - (K-1-k) * d])
(+ residual[b, co, t]): for each tap, BLOCK_CI x BLOCK_T input tiles (contiguous along time) against
BLOCK_CO x BLOCK_CI weight tiles ([K, C_out, C_in] layout, contiguous along ci), accumulated in fp32. Causal
padding is the load mask. The activation runs once per output element: fused into the convolution's input
instead, it ran once per tap and per output-channel tile, and its sine outweighed the matrix work (measured
slower than eager on an H200).

SnakeBeta is x + inv_beta[c] * sin(alpha[c] * x)^2 with exp(alpha) and 1 / (exp(beta) + eps) precomputed, in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def _snake(x, alpha, inv_beta):
    s = tl.sin(x * alpha)
    return x + inv_beta * s * s


@triton.jit
def conv_kernel(X, W, Bias, Alpha, InvBeta, Res, Out, C_in, C_out, T, dilation,
                stride_xb, stride_xc, stride_xt, stride_ob, stride_oc, stride_ot,
                K: tl.constexpr, SNAKE_OUT: tl.constexpr, HAS_RES: tl.constexpr,
                BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    b = tl.program_id(2).to(tl.int64)
    co_ok = co < C_out
    x_base = X + b * stride_xb
    acc = tl.zeros([BLOCK_CO, BLOCK_T], tl.float32)
    c_pad = tl.cdiv(C_in, BLOCK_CI) * BLOCK_CI
    for r in range(0, K * c_pad, BLOCK_CI):  # one loop over (tap, channel block): long enough to pipeline
        k = r // c_pad
        ci = r - k * c_pad + tl.arange(0, BLOCK_CI)
        ci_ok = ci < C_in
        src = t - (K - 1 - k) * dilation
        x = tl.load(x_base + ci[:, None] * stride_xc + src[None, :] * stride_xt,
                    mask=ci_ok[:, None] & ((src >= 0) & (src < T))[None, :], other=0.0)
        w = tl.load(W + (k * C_out + co[:, None]) * C_in + ci[None, :], mask=co_ok[:, None] & ci_ok[None, :],
                    other=0.0)
        acc += tl.dot(w, x, input_precision=PRECISION)
    acc += tl.load(Bias + co, mask=co_ok, other=0.0).to(tl.float32)[:, None]
    if SNAKE_OUT:
        alpha = tl.load(Alpha + co, mask=co_ok, other=0.0).to(tl.float32)
        inv_beta = tl.load(InvBeta + co, mask=co_ok, other=0.0).to(tl.float32)
        acc = _snake(acc, alpha[:, None], inv_beta[:, None])
    out_mask = co_ok[:, None] & (t < T)[None, :]
    offsets = b * stride_ob + co[:, None] * stride_oc + t[None, :] * stride_ot
    if HAS_RES:
        acc += tl.load(Res + offsets, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(Out + offsets, acc.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def snake_kernel(X, Alpha, InvBeta, Out, N, C, T, TIME_MAJOR: tl.constexpr, BLOCK: tl.constexpr):
    """Over the flat memory of a dense [B, C, T] tensor laid out [B, C, T] or, TIME_MAJOR, [B, T, C]."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    c = i % C if TIME_MAJOR else (i // T) % C
    x = tl.load(X + i, mask=ok, other=0.0).to(tl.float32)
    y = _snake(x, tl.load(Alpha + c, mask=ok, other=0.0).to(tl.float32),
               tl.load(InvBeta + c, mask=ok, other=0.0).to(tl.float32))
    tl.store(Out + i, y.to(Out.dtype.element_ty), mask=ok)
