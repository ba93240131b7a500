"""Paged prefill attention: a varlen batch of new tokens over their sequences' cached pages.

Sequence `i` owns the query tokens `query_start_loc[i]:query_start_loc[i+1]` (q_len of them),
which sit at context positions `ctx .. seq_len - 1` with `ctx = seq_len - q_len` (cached
prefix, earlier chunks). Query row `r` sees keys `0 .. ctx + r`.

Algorithm (flash attention, forward):
  * one program per (query head, BLOCK_M-tile of a sequence's queries, sequence); the head
    index varies fastest so the GROUP heads sharing a KV head run side by side and hit L2
    for each other's pages; tiles past a sequence's q_len exit at once; the last tiles
    (the longest work, causally) are scheduled first;
  * phase 1 walks the keys that every query of the tile sees (positions below the tile's
    first query, rounded down to BLOCK_N) without a causal mask; phase 2 walks the rest up to
    the tile's last query with the causal mask;
  * K/V tiles are gathered through the block table, softmax is online in fp32.

Tensor layouts:
  q          [num_tokens, num_heads, head_dim]          query head h uses kv head h // GROUP
  k/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables [num_seqs, max_blocks] int32 (last dim contiguous), seq_lens [num_seqs] int32,
  query_start_loc [num_seqs + 1] int32
  out        [num_tokens, num_heads, head_dim]          q's dtype, contiguous

Requires seq_len >= q_len for every sequence (the launcher cannot check it without a host
sync). Configs: `default_config` picks the tiles from the shape (cached per shape by
`prefill_constants`); bench/bench_attention.py sweeps them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from triton_kernels.paged_attention_common import attend_key_range

LOG2E = 1.4426950408889634


SHORT_CONTEXT = 1024  # at most this many keys per sequence: small tiles pipeline better


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tunables of the prefill kernel."""

    block_m: int = 128  # query tokens per program (power of two >= 16)
    block_n: int = 64  # keys per K/V tile (power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the key loops (GPU only)


def default_config(
    head_dim: int, max_query_len: int, max_seq_len: int = 0, dtype: torch.dtype = torch.bfloat16
) -> PrefillConfig:
    """Tiles from the shape (H200 sweep of 2026-11-29, 4 warps, 3 stages): m128/n64 for long
    contexts, m64/n32 when every context is short (`max_seq_len` bounds them; 0: unknown,
    taken as `max_query_len`), 64-row query tiles for short queries and wide heads. fp32
    (a test dtype) keeps 8 warps on 128-row tiles to hold its accumulator."""
    context = max(max_seq_len, max_query_len)
    if head_dim > 128 or context <= SHORT_CONTEXT:
        return PrefillConfig(block_m=64, block_n=32)
    if max_query_len <= 64:
        return PrefillConfig(block_m=64, block_n=64)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8 if dtype == torch.float32 else 4)


@triton.jit
def _paged_prefill_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    # sizes
    qk_scale,
    # strides
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    # constexprs
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)

    # -- the tile's queries: rows [m_tile * BLOCK_M, +BLOCK_M) of the sequence -----------
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx + rows  # context position of each query row
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok_rows = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + tok_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]

    # -- phase 1: keys below the tile's first query, seen by every row: no causal mask ----
    kv_head = head // GROUP
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    full_end = tl.maximum(((ctx + m_tile * BLOCK_M) // BLOCK_N) * BLOCK_N, 0)
    m_i, l_i, acc = attend_key_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, 0, full_end, kv_head,
        qk_scale, stride_cb, stride_ct, stride_ch,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, PRECISION,
    )  # fmt: skip

    # -- phase 2: the diagonal band up to the tile's last query, causal mask -------------
    band_end = ctx + tl.minimum((m_tile + 1) * BLOCK_M, q_len)
    m_i, l_i, acc = attend_key_range(
        q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, full_end, band_end, kv_head,
        qk_scale, stride_cb, stride_ct, stride_ch,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, PRECISION,
    )  # fmt: skip

    # -- epilogue ----------------------------------------------------------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_rows = (tok_rows * tl.num_programs(0) + head) * HEAD_DIM  # out is contiguous
    o_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@functools.lru_cache(maxsize=256)
def prefill_constants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    config: PrefillConfig | None,
) -> tuple[int, dict[str, Any]]:
    """(BLOCK_M, constexprs and launch options) of a launch; cached per shape."""
    cfg = config or default_config(head_dim, max_query_len, max_seq_len, dtype)
    constants = {
        "GROUP": num_heads // num_kv_heads, "HEAD_DIM": head_dim,
        "D_PAD": max(16, 1 << (head_dim - 1).bit_length()), "BLOCK_SIZE": block_size,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }  # fmt: skip
    return cfg.block_m, constants


def launch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32, contiguous
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, contiguous
    max_query_len: int,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], contiguous, written
    scale: float,
    config: PrefillConfig | None = None,
    *,
    max_seq_len: int = 0,
) -> None:
    """Run the prefill kernel into `out`; `max_seq_len` (a bound, 0: unknown) picks tiles."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_m, constants = prefill_constants(
        num_heads, num_kv_heads, head_dim, block_size, q.dtype, max_query_len, max_seq_len,
        config,
    )  # fmt: skip
    assert out.is_contiguous() and out.shape == q.shape, "out must be a contiguous q-shaped tensor"
    grid = (num_heads, -(-max(max_query_len, 1) // block_m), seq_lens.shape[0])
    stride_q, stride_c = q.stride(), k_cache.stride()
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        stride_q[0], stride_q[1], stride_c[0], stride_c[1], stride_c[2], block_tables.stride(0),
        **constants,
    )  # fmt: skip
