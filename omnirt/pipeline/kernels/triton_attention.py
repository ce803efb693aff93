"""The Triton kernel behind `omnirt.pipeline.kernels.attention.slot_attention`: flash attention over the slot KV cache.

Grid (batch row, KV head, block of (new token, query head) pairs). Each program streams its slot's
keys in BLOCK_N tiles up to the position of its block's last real token, keeps the running max and
denominator in fp32 (exp2 with the scale folded in) and writes only real rows.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])  # one variant for every chunk length
def slot_attention_kernel(Q, K, V, Out, Slots, Starts, Lengths, scale_log2,
                          stride_qb, stride_qh, stride_qt, stride_ks, stride_kh, stride_kl,
                          stride_ob, stride_ot, stride_oh, T,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    slot = tl.load(Slots + b)
    start = tl.load(Starts + b)
    num_valid = tl.minimum(tl.load(Lengths + b), T)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head in the group) pairs
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = tok < num_valid
    q_pos = start + tok
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + d[None, :],
                mask=valid[:, None], other=0.0)
    # keys [0, end): up to the position of the block's last real token (none when it has none)
    first_tok = block * BLOCK_M // GROUP
    last_tok = ((block + 1) * BLOCK_M - 1) // GROUP
    end = tl.where(first_tok < num_valid, start + tl.minimum(last_tok + 1, num_valid), 0)
    k_base = K + slot * stride_ks + kv_head * stride_kh
    v_base = V + slot * stride_ks + kv_head * stride_kh
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_range = n < end
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(v_base + n[:, None] * stride_kl + d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(in_range[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # a block with no real rows has none
    tl.store(Out + b * stride_ob + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=valid[:, None])
