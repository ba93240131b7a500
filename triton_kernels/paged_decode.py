"""Paged decode attention: one query token per sequence, K/V read through the block table.

Algorithm (flash-decoding):
  * one program per (sequence, kv_head, split); the sequence index varies fastest, so the
    programs in flight at once read the same key range of one KV head (a shared prefix's
    pages are then read by many programs at about the same time and come from L2). The
    GROUP query heads that share the KV head are loaded together as a [GROUP_PAD, D_PAD]
    tile (GROUP_PAD >= 16 for tl.dot; padding rows are zero and never stored), so each
    page is read once per KV head;
  * split `s` covers the key positions [s * chunk_len, (s + 1) * chunk_len): the same range
    for every sequence, a multiple of BLOCK_N and of the page size, so the splits of
    sequences that share a prefix cover identical pages. The last split also takes every
    position past the end (so a length bound that is too small costs speed, never
    correctness); splits past a sequence's end exit at once;
  * each program walks its range in BLOCK_N-token tiles gathered through the block table
    (several pages per tile when block_size < BLOCK_N), with an fp32 online softmax;
  * one split: the program normalises and writes the output directly. Several: it writes a
    normalised partial output and its log2-sum-exp, and `_paged_decode_reduce_kernel`
    merges the cdiv(seq_len, chunk_len) non-empty splits of each (sequence, head);
  * cascade (triton_kernels/paged_cascade.py): the same kernels cover only each sequence's
    own positions >= `start_pos` (the end of a shared prefix) and write their partials after
    `split_offset` prefix splits; the reduce merges the prefix splits and the own splits.
    Plain decode passes start_pos 0 and split_offset 0.

Tensor layouts:
  q          [num_seqs, num_heads, head_dim]          query head h uses kv head h // GROUP
  k/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables [num_seqs, max_blocks] int32 (last dim contiguous), seq_lens [num_seqs] int32
  out        [num_seqs, num_heads, head_dim]          q's dtype, contiguous
  part       fp32, split path only: partial outputs [num_seqs, num_heads, num_splits, D_PAD]
             followed by their log2-sum-exps [num_seqs, num_heads, num_splits]

Launch plan: `decode_plan` derives the split count, chunk length, grid and compile-time
constants from shapes and a max_seq_len bound (never tensor values), and is cached, so a
call costs one dictionary lookup plus the launches. No triton.autotune: its first-call
benchmarking would run inside CUDA-graph capture and in the slow interpreter;
`default_config` picks the tiles and bench/bench_attention.py sweeps them on the GPU.

A sequence with seq_len 0 (a padding row of a captured batch) gets an all-zero output.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.paged_attention_common import attend_key_range, store_partial
from triton_kernels.pdl import early_launch, launch_options

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
SMEM_BUDGET = 128 * 1024  # shared memory for the K/V stages of a fallback config
BOUND_BUCKET = 128  # length bounds are rounded up to this, so consecutive steps share a plan
SHORT_BOUND = 256  # tokens: bounds up to this take small tiles when the grid is large
# Split cost model, in units of "one token of one KV head streamed by one SM", fitted to
# the 2026-11-29 H200 sweep (bench/results/attention_20261129-215357.json):
PROGRAM_COST_TOKENS = 48  # fixed cost of one more program: q load, pipeline fill, merge
TAIL_FRACTION = 0.45  # share of the longest program's time that the last wave adds


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tunables of the decode kernel."""

    block_n: int = 128  # tokens per K/V tile (power of two >= 16)
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # software-pipelining depth of the tile loop (GPU only)


def default_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """Tiles for a cache shape. 16-bit caches up to head_dim 128: 128-token tiles, 4 warps, 3
    stages (best or within 1% of it on every unique-context case of the H200 sweep; its K/V
    buffers take up to 192 KB of shared memory). Otherwise the widest tile whose two stages
    of K/V fit in SMEM_BUDGET. Any tile works with any page size."""
    if head_dim <= 128 and dtype != torch.float32:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=3)
    row_bytes = max(16, _next_pow2(head_dim)) * (4 if dtype == torch.float32 else 2)
    block_n = 64
    while block_n > 16 and 2 * 2 * block_n * row_bytes > SMEM_BUDGET:
        block_n //= 2
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2)


def _single_split_config(
    cfg: DecodeConfig, programs: int, num_sms: int, bound: int
) -> DecodeConfig:
    """The default tiles adjusted for a one-split grid of `programs` programs.

    Short bounds (<= SHORT_BOUND tokens, at most two default tiles per program) take small
    tiles, so that many programs fit on an SM at once: their 128-token tiles in 2-3 stages
    take 128-192 KB of shared memory and leave one program per SM, and the grid then runs in
    waves of about 2 us each. H200 sweep of 2026-12-01 (32 chained launches, 32/32 heads, page 16,
    bound 256; bench/results/engine_2026-12-01b_notes.md): with >= 6 programs per SM,
    32-token tiles and one warp (B=64, 136 tokens: 40.6 vs 54.6 us; 24 tokens: 11.4 vs 28.1);
    with >= 2, 64-token tiles and two warps (B=16, 136 tokens: 13.5 vs 14.1 us).

    Longer bounds, from the sweeps of 2026-11-29/30 (two runs agree): with few programs per
    SM, 64-token tiles (B=64 x 8 kv heads, mean 559: 53.9 vs 55.7 us); with many, two
    pipeline stages, which leave room for more resident programs (B=256 x 8, mean 1001: 268.0
    vs 270.7-271.1 us)."""
    if cfg != DecodeConfig(block_n=128, num_warps=4, num_stages=3):
        return cfg
    if bound <= SHORT_BOUND and programs >= 6 * num_sms:
        return DecodeConfig(block_n=32, num_warps=1, num_stages=3)
    if bound <= SHORT_BOUND and programs >= 2 * num_sms:
        return DecodeConfig(block_n=64, num_warps=2, num_stages=3)
    if bound <= SHORT_BOUND and 4 * programs <= num_sms:
        return cfg  # one or two default tiles per program (see choose_splits)
    if programs <= 4 * num_sms:
        return DecodeConfig(block_n=64, num_warps=4, num_stages=3)
    if programs >= 8 * num_sms:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2)
    return cfg


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Everything a decode launch needs that depends only on shapes and the length bound."""

    num_splits: int  # programs per (sequence, kv head); 1: no partials, no reduce kernel
    chunk_len: int  # key positions per split, a multiple of BLOCK_N and of the page size
    grid: tuple[int, int, int]  # (num_seqs, num_kv_heads, num_splits)
    constants: dict[str, Any]  # constexprs and launch options of the decode kernel
    part_numel: int  # fp32 elements of the split scratch buffer (0 without splits)
    reduce_constants: dict[str, Any]  # constexprs and launch options of the reduce kernel


def choose_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, align: int, num_sms: int
) -> tuple[int, int]:
    """(num_splits, chunk_len) minimising a makespan model of the decode grid.

    Time ~ work / SMs busy + TAIL_FRACTION * longest program, where work counts every
    program's tokens (taken as `max_seq_len`, an upper bound) plus PROGRAM_COST_TOKENS per
    program. More splits shorten the tail (the longest program) and fill the SMs of small
    batches; each costs a program per (sequence, kv head). Only shapes are read.

    The model has no term for the reduce kernel, whose launch after the split programs is
    about as long as a short key range: with bounds of at most SHORT_BOUND and at most a
    quarter as many programs as SMs, one split (H200 sweep of 2026-12-01, B=1 x 32 KV heads,
    bound 256, contexts 24 / 72 / 136 / 250: 3.39 / 3.83 / 6.03 / 6.44 us against 4.84 /
    5.50 / 6.20 / 6.58 with two splits).
    """
    longest = max(max_seq_len, 1)
    programs = max(num_seqs * num_kv_heads, 1)
    if longest <= SHORT_BOUND and 4 * programs <= num_sms:
        return 1, _round_up(longest, align)
    best: tuple[float, int, int] | None = None
    for wanted in range(1, MAX_SPLITS + 1):
        chunk = _round_up(_cdiv(longest, wanted), align)
        splits = _cdiv(longest, chunk)
        if splits < wanted:
            continue  # the same chunk as a smaller count
        work = programs * (longest + PROGRAM_COST_TOKENS * splits)
        cost = work / min(programs * splits, num_sms) + TAIL_FRACTION * chunk
        if best is None or cost < best[0]:
            best = (cost, splits, chunk)
    assert best is not None  # wanted == 1 always qualifies
    return best[1], best[2]


@functools.lru_cache(maxsize=1024)
def decode_plan(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_seq_len: int,
    num_splits: int | None,
    config: DecodeConfig | None,
    num_sms: int,
) -> DecodePlan:
    """The launch plan; `num_splits` forces the split count, `config` the tiles."""
    cfg = config or default_config(head_dim, dtype)
    align = math.lcm(cfg.block_n, block_size)  # splits start on a tile and a page boundary
    bound = max(max_seq_len, 1)
    if num_splits is None:
        splits, chunk = choose_splits(num_seqs, num_kv_heads, bound, align, num_sms)
        if config is None and splits == 1:
            cfg = _single_split_config(cfg, num_seqs * num_kv_heads, num_sms, bound)
            chunk = _round_up(bound, math.lcm(cfg.block_n, block_size))
    else:
        chunk = _round_up(_cdiv(bound, num_splits), align)
        splits = min(num_splits, _cdiv(bound, chunk))
    group = num_heads // num_kv_heads
    d_pad = max(16, _next_pow2(head_dim))
    constants = {
        "GROUP": group, "GROUP_PAD": max(16, _next_pow2(group)), "HEAD_DIM": head_dim,
        "D_PAD": d_pad, "BLOCK_SIZE": block_size, "BLOCK_N": cfg.block_n, "SPLIT": splits > 1,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }  # fmt: skip
    splits_pad = _next_pow2(splits)
    reduce_constants = {
        "HEAD_DIM": head_dim, "D_PAD": d_pad, "SPLITS_PAD": splits_pad,
        "num_warps": 4 if d_pad * splits_pad <= 4096 else 8,
    }  # fmt: skip
    part_numel = num_seqs * num_heads * splits * (d_pad + 1) if splits > 1 else 0
    grid = (num_seqs, num_kv_heads, splits)
    return DecodePlan(splits, chunk, grid, constants, part_numel, reduce_constants)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, multiple: int) -> int:
    return _cdiv(a, multiple) * multiple


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 1 on CPU (the interpreter runs programs in turn)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    # pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_ptr,
    # sizes
    qk_scale,
    chunk_len,
    start_pos,  # first key position (0; a cascade's shared prefix length)
    split_offset,  # partial rows of other kernels before this one's (0; cascade: prefix splits)
    # strides
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    # constexprs
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # -- this program's key range: split `split` of the common chunk grid ------------------
    if SPLIT:
        start = start_pos + split * chunk_len
        if start >= seq_len:
            return  # past the sequence's end: the reduce kernel skips this split
        last = split == tl.num_programs(2) - 1
        end = tl.where(last, seq_len, tl.minimum(start + chunk_len, seq_len))
    else:
        start = 0
        end = seq_len

    # -- the GROUP query heads of this kv head: [GROUP_PAD, D_PAD] -----------------------
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads * stride_qh
    q = tl.load(
        q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0
    )

    # -- online softmax over BLOCK_N-token tiles gathered through the block table --------
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i, l_i, acc = attend_key_range(
        q, offs_g, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bts, start, end, kv_head, qk_scale,
        stride_cb, stride_ct, stride_ch,
        HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, False, PRECISION,
    )  # fmt: skip

    # -- epilogue: normalised output (0 for an empty range) -----------------------------
    num_heads = GROUP * tl.num_programs(1)
    if SPLIT:
        # row of (seq, head, split) in the partials; the log2-sum-exps follow all rows
        part_splits = split_offset + tl.num_programs(2)
        rows = (seq.to(tl.int64) * num_heads + heads) * part_splits + split_offset + split
        lse_base = tl.num_programs(0).to(tl.int64) * num_heads * part_splits * D_PAD
        store_partial(part_ptr, rows, lse_base, offs_d, acc, m_i, l_i, g_mask, D_PAD)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = out_ptr + (seq.to(tl.int64) * num_heads + heads) * HEAD_DIM
        o_mask = g_mask[:, None] & d_mask[None, :]
        tl.store(o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    # pointers
    part_ptr,
    seq_lens_ptr,
    out_ptr,
    # sizes
    chunk_len,
    num_splits,  # partial rows per (sequence, head)
    num_prefix_splits,  # the first rows: a cascade's prefix partials, always written (else 0)
    own_start,  # first position the other splits cover (0; a cascade's prefix length)
    # constexprs
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)

    # -- the sequence's non-empty splits (none for seq_len 0: the output is 0) ------------
    seq_len = tl.load(seq_lens_ptr + seq)
    own_len = tl.maximum(seq_len - own_start, 0)
    own_splits = tl.minimum(tl.cdiv(own_len, chunk_len), num_splits - num_prefix_splits)
    s_mask = offs_s < num_prefix_splits + own_splits
    rows = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s  # [SPLITS_PAD]

    # -- split weights 2^(lse_s - max lse) ------------------------------------------------
    lse_base = tl.num_programs(0).to(tl.int64) * num_heads * num_splits * D_PAD
    lse = tl.load(part_ptr + lse_base + rows, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # 0 for masked splits
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)

    # -- weighted sum of the normalised partial outputs: [SPLITS_PAD, D_PAD] -------------
    parts = tl.load(
        part_ptr + rows[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    o = tl.sum(parts * w[:, None], 0) / denom
    o_ptr = out_ptr + (seq.to(tl.int64) * num_heads + head) * HEAD_DIM + offs_d
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


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
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    *,
    max_seq_len: int | None = None,
) -> DecodePlan:
    """Run the decode kernel (and the split reduction when the plan splits) into `out`.

    `max_seq_len` bounds seq_lens for the plan (default: the block-table capacity);
    `num_splits` forces the split count (None: `choose_splits`). Returns the plan used.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    bound = _round_up(max(bound, 1), BOUND_BUCKET)
    plan = decode_plan(
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, q.dtype, bound, num_splits,
        config, num_sms(q.device),
    )  # fmt: skip
    assert out.is_contiguous() and out.shape == q.shape, "out must be a contiguous q-shaped tensor"
    part = out  # unused without splits; any tensor gives the kernel a valid pointer
    if plan.part_numel:
        part = torch.empty(plan.part_numel, dtype=torch.float32, device=q.device)
    stride_q, stride_c = q.stride(), k_cache.stride()
    pdl = early_launch(q.device)
    _paged_decode_kernel[plan.grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, part,
        scale * LOG2E, plan.chunk_len, 0, 0,
        stride_q[0], stride_q[1], stride_c[0], stride_c[1], stride_c[2], block_tables.stride(0),
        PDL=pdl, **plan.constants, **launch_options(pdl),
    )  # fmt: skip
    if plan.num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part,
            seq_lens,
            out,
            plan.chunk_len,
            plan.num_splits,
            0,
            0,
            PDL=early_launch(q.device),
            **plan.reduce_constants,
        )
    return plan
