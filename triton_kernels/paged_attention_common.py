"""Building blocks shared by the paged decode and prefill attention kernels.

Paged KV layout (both caches, same strides): `[num_blocks, block_size, num_kv_heads,
head_dim]`, last dim contiguous. Token `t` of a sequence lives in page
`block_table[t // BLOCK_SIZE]` at row `t % BLOCK_SIZE`. A tile of BLOCK_N consecutive tokens
may span several pages (BLOCK_N > BLOCK_SIZE) or part of one page (BLOCK_N < BLOCK_SIZE):
the address of every row is computed from its own page id, so any page size works and each
row is one contiguous head_dim vector.

The online-softmax step works in base 2: scores are multiplied by `scale * log2(e)` once, so
`exp2` replaces `exp` and the running max `m` and sum `l` are in those units.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_row_offsets(
    block_table_row_ptr,  # the sequence's row of block_tables
    toks,  # [BLOCK_N] token positions in the sequence
    tok_mask,  # [BLOCK_N] which positions are real; the others read page 0
    kv_head,
    stride_b,  # cache strides (k_cache and v_cache share them)
    stride_t,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """[BLOCK_N] int64 element offsets of the tokens' head_dim rows, through the block table."""
    block_ids = tl.load(block_table_row_ptr + toks // BLOCK_SIZE, mask=tok_mask, other=0)
    return block_ids.to(tl.int64) * stride_b + (toks % BLOCK_SIZE) * stride_t + kv_head * stride_h


@triton.jit
def online_softmax_step(
    q,  # [M, D_PAD] query tile (input dtype)
    k,  # [BLOCK_N, D_PAD]
    v,  # [BLOCK_N, D_PAD]
    visible,  # [M, BLOCK_N] bool: which scores take part
    m_i,  # [M] fp32 running max (base-2 units)
    l_i,  # [M] fp32 running sum of exp2
    acc,  # [M, D_PAD] fp32 unnormalised output
    qk_scale,  # scale * log2(e)
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact dots, not tf32), else "tf32"
):
    """Fold one K/V tile into the running (max, sum, output) of a flash-attention loop."""
    # -- scores: [M, BLOCK_N] in base-2 units --------------------------------------------
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(visible, s * qk_scale, float("-inf"))
    # -- rescale the running state to the new max ---------------------------------------
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing visible so far keeps m = -inf; use 0 to avoid (-inf) - (-inf)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # -- accumulate P @ V in fp32 (P rounded to V's dtype, as flash attention does) --------
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
