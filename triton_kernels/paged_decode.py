"""Paged decode attention: one query token per sequence, K/V read through the block table.

Algorithm (flash-decoding):
  * one program per (sequence, kv_head, split). The GROUP query heads that share the KV head
    are loaded together as a [GROUP_PAD, D_PAD] tile (GROUP_PAD >= 16 for tl.dot; padding
    rows are zero and never stored), so each page is read once per KV head;
  * the sequence's context is cut into `num_splits` equal ranges, rounded up to BLOCK_N
    tokens, computed per sequence from its own seq_len on the device. A short sequence gets
    short splits and some empty ones; the split count only changes speed, never the result;
  * each program walks its range in BLOCK_N-token tiles gathered through the block table
    (several pages per tile when block_size < BLOCK_N), with an fp32 online softmax;
  * num_splits == 1: the program normalises and writes the output directly;
    num_splits > 1: it writes a normalised partial output and its log2-sum-exp, and
    `_paged_decode_reduce_kernel` merges the splits of each (sequence, head).

Tensor layouts:
  q          [num_seqs, num_heads, head_dim]          query head h uses kv head h // GROUP
  k/v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables [num_seqs, max_blocks] int32, seq_lens [num_seqs] int32
  out        [num_seqs, num_heads, head_dim]          q's dtype
  part_out   [num_seqs, num_heads, num_splits, D_PAD] fp32 (split path only)
  part_lse   [num_seqs, num_heads, num_splits]        fp32, -inf for an empty split

Split count: `choose_num_splits` (shapes and a max_seq_len bound, never tensor values).
Configs: no triton.autotune (its first-call benchmarking would run inside CUDA-graph capture
and in the slow interpreter); `DecodeConfig` holds the tunables, `default_config` picks them
from the shape, and bench/bench_attention.py sweeps them on the GPU.

A sequence with seq_len 0 (a padding row of a captured batch) gets an all-zero output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels.paged_attention_common import attend_key_range

LOG2E = 1.4426950408889634
SPLIT_PROGRAMS_PER_SM = 4  # split the context until the grid has this many programs per SM
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more (q load, merge) than it hides
MAX_SPLITS = 32


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tunables of the decode kernel."""

    block_n: int = 64  # tokens per K/V tile (power of two >= 16)
    num_warps: int = 4  # warps per program
    num_stages: int = 2  # software-pipelining depth of the tile loop (GPU only)


def default_config(head_dim: int, block_size: int) -> DecodeConfig:
    """Tile config for a cache shape; 64-token tiles keep ~32 KB of K/V in flight per stage."""
    block_n = 64 if head_dim <= 128 else 32
    return DecodeConfig(block_n=max(block_n, min(block_size, 128)), num_warps=4, num_stages=2)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split count from shapes and a length bound: fill the SMs, keep splits long enough."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-SPLIT_PROGRAMS_PER_SM * _num_sms(device) // programs)
    by_length = max(max_seq_len // MIN_SPLIT_TOKENS, 1)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # interpreter: programs run one after another
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
    part_out_ptr,
    part_lse_ptr,
    # sizes
    qk_scale,
    num_splits,
    # strides
    stride_qs,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bts,
    stride_os,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    # constexprs
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- this program's token range: split `split` of the sequence's context -------------
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

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
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        po_rows = part_out_ptr + seq.to(tl.int64) * stride_pos + heads * stride_poh
        po_rows += split * stride_pop
        tl.store(po_rows[:, None] + offs_d[None, :], o, mask=g_mask[:, None])
        pl = part_lse_ptr + seq.to(tl.int64) * stride_pls + heads * stride_plh + split
        tl.store(pl, lse, mask=g_mask)
    else:
        o_rows = out_ptr + seq.to(tl.int64) * stride_os + heads * stride_oh
        o_mask = g_mask[:, None] & d_mask[None, :]
        tl.store(o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    # pointers
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    # sizes
    num_splits,
    # strides
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    stride_os,
    stride_oh,
    # constexprs
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits

    # -- split weights: 2^(lse_s - max lse); empty splits (lse = -inf) weigh 0 ------------
    pl = part_lse_ptr + seq.to(tl.int64) * stride_pls + head * stride_plh
    lse = tl.load(pl + offs_s, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)

    # -- weighted sum of the normalised partial outputs: [SPLITS_PAD, D_PAD] -------------
    po = part_out_ptr + seq.to(tl.int64) * stride_pos + head * stride_poh
    parts = tl.load(
        po + offs_s[:, None] * stride_pop + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    o = tl.sum(parts * w[:, None], 0) / denom
    o_ptr = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------


def launch(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
    scale: float,
    num_splits: int,
    config: DecodeConfig | None = None,
) -> None:
    """Run the decode kernel (and the split reduction when num_splits > 1) into `out`."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = config or default_config(head_dim, block_size)
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:  # unused by the kernel; any fp32 tensors give it valid pointers and strides
        part_out = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out,
            num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, D_PAD=d_pad,
            num_warps=4 if d_pad * num_splits <= 4096 else 8,
        )  # fmt: skip
