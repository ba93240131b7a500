"""Building blocks shared by the paged decode and prefill attention kernels.

Paged KV layout (both caches, same strides): `[num_blocks, block_size, num_kv_heads,
head_dim]`, last dim contiguous. Token `t` of a sequence lives in page
`block_table[t // BLOCK_SIZE]` at row `t % BLOCK_SIZE`. A tile of BLOCK_N consecutive tokens
may span several pages (BLOCK_N > BLOCK_SIZE) or part of one page (BLOCK_N < BLOCK_SIZE):
the address of every row is computed from its own page id, so any page size works and each
row is one contiguous head_dim vector.

The online softmax works in base 2: scores are multiplied by `scale * log2(e)` once, so
`exp2` replaces `exp` and the running max `m` and sum `l` are in those units.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_key_range(
    q,  # [M, D_PAD] query tile (input dtype), zero in padding rows/columns
    q_pos,  # [M] context position of each query row (read when CAUSAL)
    m_i,  # [M] fp32 running max (base-2 units)
    l_i,  # [M] fp32 running sum of exp2
    acc,  # [M, D_PAD] fp32 unnormalised output
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,  # the sequence's row of block_tables
    lo,  # first key position
    hi,  # one past the last key position
    kv_head,
    qk_scale,  # scale * log2(e)
    stride_cb,  # cache strides (k_cache and v_cache share them)
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # page size
    BLOCK_N: tl.constexpr,  # keys per tile
    CAUSAL: tl.constexpr,  # mask key > q_pos (only the diagonal band needs it)
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (exact dots, not tf32), else "tf32"
):
    """Fold keys [lo, hi) of one KV head into the running (max, sum, output) of a
    flash-attention loop, gathering BLOCK_N-token K/V tiles through the block table."""
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    for tile_start in range(lo, hi, BLOCK_N):
        # -- gather the tile: each token's row from its own page -------------------------
        toks = tile_start + tl.arange(0, BLOCK_N)
        tok_mask = toks < hi
        block_ids = tl.load(block_table_row_ptr + toks // BLOCK_SIZE, mask=tok_mask, other=0)
        rows = block_ids.to(tl.int64) * stride_cb + (toks % BLOCK_SIZE) * stride_ct
        kv_ptrs = rows[:, None] + kv_head * stride_ch + offs_d[None, :]  # [BLOCK_N, D_PAD]
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        # -- scores [M, BLOCK_N] in base-2 units, masked ---------------------------------
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where(tok_mask[None, :] & (toks[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(tok_mask[None, :], s, float("-inf"))
        # -- online softmax: rescale the running state to the new max --------------------
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # P rounded to V's dtype for the tensor cores, as flash attention does
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_partial(
    part_ptr,  # fp32 partial outputs [rows, D_PAD], then their log2-sum-exps [rows]
    rows,  # [M] int64 partial row of each query row
    lse_base,  # element offset of the log2-sum-exps
    offs_d,  # [D_PAD]
    acc,  # [M, D_PAD] fp32 unnormalised output
    m_i,  # [M] fp32 running max (base-2 units)
    l_i,  # [M] fp32 running sum of exp2
    mask,  # [M] rows to write
    D_PAD: tl.constexpr,
):
    """Write a key range's normalised partial output and its log2-sum-exp per query row, for a
    reduce kernel to merge; an empty range (l = 0) gives a zero output and -inf."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(part_ptr + rows[:, None] * D_PAD + offs_d[None, :], o, mask=mask[:, None])
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(part_ptr + lse_base + rows, lse, mask=mask)
