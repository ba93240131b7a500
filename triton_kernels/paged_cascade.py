"""Cascade paged decode attention: a prefix shared by every sequence is read once per KV head.

Decode over a batch whose block tables all start with the same `prefix_len // BLOCK_SIZE`
pages (a cached system prompt) splits each sequence's keys in two parts:

  * prefix: `_cascade_prefix_kernel` takes the GROUP query heads of one KV head of every
    sequence as one flattened [num_seqs * GROUP, D_PAD] query matrix (row r is sequence
    r // GROUP, head kv_head * GROUP + r % GROUP) and runs a flash-attention loop of
    BLOCK_M-row tiles over the prefix keys, gathered through row 0 of the block table, with
    tl.dot on [BLOCK_M, BLOCK_N] score tiles. One program per (row tile, kv head, prefix
    split); split `s` covers keys [s * prefix_chunk, min((s + 1) * prefix_chunk, prefix_len)),
    so the prefix is streamed cdiv(num_rows, BLOCK_M) times per KV head instead of num_seqs
    times. Each row only sees keys < its own seq_len (so a padding row with seq_len 0 gets an
    all-masked, empty partial);
  * own part: `paged_decode._paged_decode_kernel` with start_pos = prefix_len covers each
    sequence's positions [prefix_len, seq_len), split-K as in plain decode, always writing
    partials;
  * `paged_decode._paged_decode_reduce_kernel` merges, per (sequence, head), the prefix
    partials (rows 0..P-1, always written) and the non-empty own partials (rows P..).

Tensor layouts: those of triton_kernels/paged_decode.py (q, k/v_cache, block_tables, seq_lens,
out). part: fp32 partial outputs [num_seqs, num_heads, P + own_splits, D_PAD] followed by
their log2-sum-exps [num_seqs, num_heads, P + own_splits].

Launch plan: `cascade_plan` derives both grids from shapes, the prefix length and a bound
of the own lengths (never tensor values), cached, so a call costs a dictionary lookup plus
three launches, nothing syncs with the host and the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from triton_kernels.paged_attention_common import attend_key_range, store_partial
from triton_kernels.paged_decode import (
    BOUND_BUCKET,
    LOG2E,
    DecodeConfig,
    _next_pow2,
    _paged_decode_kernel,
    _paged_decode_reduce_kernel,
    _round_up,
    decode_plan,
    num_sms,
)
from triton_kernels.pdl import early_launch

MAX_PREFIX_SPLITS = 32
PREFIX_WAVES = 2.0  # prefix programs per SM the automatic split count aims for (H200 sweep:
# B=64, 2048-token prefix: 8 splits 45.9 us, 4 splits 49.7 us, 16 splits 52.1 us)


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """Tunables of the prefix kernel."""

    block_m: int = 64  # flattened query rows per program (power of two >= 16)
    block_n: int = 64  # prefix keys per tile (power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the key loop (GPU only)
    prefix_splits: int | None = None  # None: about PREFIX_WAVES waves of programs


def default_cascade_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> CascadeConfig:
    """64 x 64 tiles, 4 warps, 3 stages for 16-bit heads up to 128 (Q, K and V tiles take
    16 KB each at head_dim 128); two stages of 32-key tiles for fp32 or wider heads."""
    if head_dim <= 128 and dtype != torch.float32:
        return CascadeConfig()
    return CascadeConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """Everything a cascade launch needs that depends only on shapes, the prefix length and
    the own-length bound. Partial rows: prefix splits first, then own splits."""

    prefix_splits: int  # P: prefix programs per (row tile, kv head)
    prefix_chunk: int  # prefix keys per split, a multiple of BLOCK_N
    prefix_grid: tuple[int, int, int]  # (row tiles, num_kv_heads, P)
    prefix_constants: dict[str, Any]  # constexprs and launch options of the prefix kernel
    own_splits: int  # own-part programs per (sequence, kv head)
    own_chunk: int  # own key positions per split
    own_grid: tuple[int, int, int]  # (num_seqs, num_kv_heads, own_splits)
    own_constants: dict[str, Any]  # constexprs of the decode kernel, SPLIT on
    num_splits: int  # P + own_splits: partial rows per (sequence, head)
    part_numel: int  # fp32 elements of the partial buffer
    reduce_constants: dict[str, Any]


def choose_prefix_splits(programs: int, prefix_tiles: int, sms: int) -> int:
    """Split count so that `programs` (row tiles x kv heads) per split fill about
    PREFIX_WAVES waves of `sms`; each split keeps at least one key tile."""
    wanted = max(1, round(PREFIX_WAVES * sms / max(programs, 1)))
    return max(1, min(wanted, prefix_tiles, MAX_PREFIX_SPLITS))


@functools.lru_cache(maxsize=1024)
def cascade_plan(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    prefix_len: int,
    own_bound: int,
    num_splits: int | None,
    config: CascadeConfig | None,
    decode_config: DecodeConfig | None,
    sms: int,
) -> CascadePlan:
    """The plan; `num_splits` forces the own split count, the configs the tiles."""
    assert prefix_len > 0 and prefix_len % block_size == 0
    cfg = config or default_cascade_config(head_dim, dtype)
    group = num_heads // num_kv_heads
    rows = num_seqs * group
    block_m = min(cfg.block_m, max(16, _next_pow2(rows)))
    row_tiles = -(-rows // block_m)
    prefix_tiles = -(-prefix_len // cfg.block_n)
    wanted = cfg.prefix_splits or choose_prefix_splits(row_tiles * num_kv_heads, prefix_tiles, sms)
    chunk = _round_up(-(-prefix_len // min(wanted, prefix_tiles)), cfg.block_n)
    splits = -(-prefix_len // chunk)  # every split non-empty
    d_pad = max(16, _next_pow2(head_dim))
    precision = "ieee" if dtype == torch.float32 else "tf32"
    prefix_constants = {
        "GROUP": group, "HEAD_DIM": head_dim, "D_PAD": d_pad, "BLOCK_SIZE": block_size,
        "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "PRECISION": precision,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }  # fmt: skip
    own = decode_plan(
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, own_bound, num_splits,
        decode_config, sms,
    )  # fmt: skip
    total = splits + own.num_splits
    splits_pad = _next_pow2(total)
    reduce_constants = {
        "HEAD_DIM": head_dim, "D_PAD": d_pad, "SPLITS_PAD": splits_pad,
        "num_warps": 4 if d_pad * splits_pad <= 4096 else 8,
    }  # fmt: skip
    return CascadePlan(
        prefix_splits=splits,
        prefix_chunk=chunk,
        prefix_grid=(row_tiles, num_kv_heads, splits),
        prefix_constants=prefix_constants,
        own_splits=own.num_splits,
        own_chunk=own.chunk_len,
        own_grid=own.grid,
        own_constants={**own.constants, "SPLIT": True},
        num_splits=total,
        part_numel=num_seqs * num_heads * total * (d_pad + 1),
        reduce_constants=reduce_constants,
    )


# ---------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _cascade_prefix_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # row 0 holds the shared prefix pages
    seq_lens_ptr,
    part_ptr,
    # sizes
    num_seqs,
    qk_scale,
    prefix_len,
    prefix_chunk,
    num_splits,  # partial rows per (sequence, head): prefix splits + own splits
    # strides
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    # constexprs
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- BLOCK_M flattened (sequence, group member) rows of this kv head: [BLOCK_M, D_PAD] --
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < num_seqs * GROUP
    seq = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads * stride_qh
    q = tl.load(
        q_rows[:, None] + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0
    )
    # each row sees keys < its seq_len: the causal mask with q_pos = seq_len - 1
    last_pos = tl.load(seq_lens_ptr + seq, mask=r_mask, other=0) - 1

    # -- online softmax over this split's prefix keys, pages from row 0 of the table -------
    lo = split * prefix_chunk
    hi = tl.minimum(lo + prefix_chunk, prefix_len)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i, l_i, acc = attend_key_range(
        q, last_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, lo, hi,
        kv_head, qk_scale, stride_cb, stride_ct, stride_ch,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, True, PRECISION,
    )  # fmt: skip

    # -- epilogue: normalised partial output and log2-sum-exp (-inf, 0 for an empty row) ---
    num_heads = GROUP * tl.num_programs(1)
    part_rows = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
    lse_base = (num_heads * num_seqs).to(tl.int64) * num_splits * D_PAD
    store_partial(part_ptr, part_rows, lse_base, offs_d, acc, m_i, l_i, r_mask, D_PAD)


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------


def launch(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32, contiguous
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], contiguous, written
    scale: float,
    prefix_len: int,
    num_splits: int | None = None,
    config: CascadeConfig | None = None,
    decode_config: DecodeConfig | None = None,
    *,
    max_seq_len: int | None = None,
) -> CascadePlan:
    """Cascade decode into `out`: prefix kernel, own-part decode, reduce. Returns the plan.

    The first prefix_len // block_size entries of every block-table row must be equal and
    `prefix_len` (> 0) a multiple of the page size; `max_seq_len` bounds seq_lens for the
    own-part plan (default: the block-table capacity); `num_splits` forces the own split count.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    own_bound = _round_up(max(bound - prefix_len, 1), BOUND_BUCKET)
    plan = cascade_plan(
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, q.dtype, prefix_len,
        own_bound, num_splits, config, decode_config, num_sms(q.device),
    )  # fmt: skip
    assert out.is_contiguous() and out.shape == q.shape, "out must be a contiguous q-shaped tensor"
    part = torch.empty(plan.part_numel, dtype=torch.float32, device=q.device)
    stride_q, stride_c = q.stride(), k_cache.stride()
    qk_scale = scale * LOG2E
    _cascade_prefix_kernel[plan.prefix_grid](
        q, k_cache, v_cache, block_tables, seq_lens, part,
        num_seqs, qk_scale, prefix_len, plan.prefix_chunk, plan.num_splits,
        stride_q[0], stride_q[1], stride_c[0], stride_c[1], stride_c[2],
        **plan.prefix_constants,
    )  # fmt: skip
    _paged_decode_kernel[plan.own_grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part,
        qk_scale, plan.own_chunk, prefix_len, plan.prefix_splits,
        stride_q[0], stride_q[1], stride_c[0], stride_c[1], stride_c[2], block_tables.stride(0),
        **plan.own_constants,
    )  # fmt: skip
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        part, seq_lens, out, plan.own_chunk, plan.num_splits, plan.prefix_splits, prefix_len,
        PDL=early_launch(q.device), **plan.reduce_constants,
    )  # fmt: skip
    return plan
