"""Paged attention ops: KV write, decode and prefill attention over a paged KV cache.

Each op checks its inputs (ValueError naming the mismatch), then runs either the Triton
kernels (`triton_kernels/`) or the plain-PyTorch reference (`attention_reference.py`, whose
names are importable from here too). The backend is read per call from
PAGEDQ_ATTENTION_BACKEND:

  auto (default)  Triton on CUDA tensors, the reference on CPU tensors;
  triton          the Triton kernels; on CPU tensors they run in the Triton interpreter
                  (TRITON_INTERPRET=1 is set before the kernel module is first imported);
  torch           the reference everywhere.

The Triton launchers never read tensor values on the host and compile one variant per
(dtype, head_dim, GQA group, block_size, tiles) plus split/no-split, so a decode step can be
captured in a CUDA graph. The decode split count depends only on shapes and on the
`max_seq_len` bound, and the last split takes whatever lies past the bound, so a bound that
is too small or too large costs speed, never correctness.

Cascade decode (`shared_prefix_len > 0`): when every block-table row starts with the same
pages, a prefix kernel reads them once per KV head for all sequences' queries together and
the decode kernel covers only each sequence's own positions (triton_kernels/paged_cascade.py).

Host cost per call is kept to attribute reads: the checks of q and the caches (stable for a
model) and every launch plan are cached per shape; block tables and lengths, which change
every step, get a few cheap comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from pagedq.ops.attention_checks import (
    BACKEND_ENV,
    check_attention,
    check_kv,
    check_shared_prefix,
    check_tables,
    spec,
)
from pagedq.ops.attention_reference import (
    gather_context,
    reference_decode_attention,
    reference_prefill_attention,
    reference_write_kv,
)
from pagedq.ops.triton_loader import env_backend, load_kernels

__all__ = [
    "AttentionMetadata",
    "attention_backend",
    "gather_context",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference_decode_attention",
    "reference_prefill_attention",
    "reference_write_kv",
    "write_kv",
]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where a flat batch of tokens reads and writes the paged KV cache.

    The batch holds the new tokens of `num_seqs` sequences back to back; sequence `i` owns
    tokens `query_start_loc[i]:query_start_loc[i+1]`, which sit at the last positions of its
    context: positions `seq_lens[i] - q_len_i .. seq_lens[i] - 1`. Their K/V are written by
    `write_kv` before attention reads them, so attention reads all `seq_lens[i]` positions from
    the cache (cached prefix and earlier chunks included) and applies a causal mask to the
    new tokens.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    max_query_len: int  # longest query of the batch (1: pure decode)
    max_seq_len: int  # longest context of the batch
    # decode only: tokens of leading pages that every block-table row shares, a multiple of
    # the page size below every seq_len (0: no cascade); see paged_decode_attention
    shared_prefix_len: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: the decode kernel applies."""
        return self.max_query_len == 1


# ---------------------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------------------


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter the new tokens' K/V into the caches at `slot_mapping` (in place).

    A negative slot skips its token (padding rows of a captured batch).
    """
    triton = attention_backend(k.device) == "triton"
    check_write_kv(k, v, k_cache, v_cache, slot_mapping, triton)
    if not triton:
        reference_write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    kernels = _triton_kernels("kv_write", k.device)
    kernels.launch(
        _last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache,
        _last_dim_contiguous(slot_mapping),
    )  # fmt: skip


def check_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    triton: bool,
) -> None:
    """`write_kv`'s argument checks (also those of the fused RoPE + KV write)."""
    check_kv(spec(k), spec(v), spec(k_cache), spec(v_cache), triton)
    if (
        slot_mapping.dtype not in (torch.int64, torch.int32)
        or slot_mapping.shape != k.shape[:1]
        or slot_mapping.device != k.device
    ):
        raise ValueError(
            f"slot_mapping must be int64 [{k.shape[0]}] on {k.device}, "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}"
        )


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    shared_prefix_len: int = 0,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """Attention of one new query token per sequence over its whole cached context.

    `max_seq_len` is an upper bound of `seq_lens` used only to plan the split-K launch
    (default: the block-table capacity); `num_splits` forces the split count (1: no
    split-K). A sequence with seq_len 0 gets an all-zero output.

    `shared_prefix_len` (a multiple of the page size, default 0: plain decode) is the
    caller's promise that the first shared_prefix_len // block_size entries of every
    block-table row are the same pages and that every seq_len exceeds it (padding rows with
    seq_len 0 excepted: they get zeros). The Triton path then reads those pages, from row
    0, once per KV head for all sequences (cascade) and `num_splits` applies to the own
    positions only. The promise is not checked against tensor values (no host sync); the
    reference ignores it (same math).
    """
    triton = attention_backend(q.device) == "triton"
    check_attention(spec(q), spec(k_cache), spec(v_cache), triton)
    check_tables(block_tables, seq_lens, q.device)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query per sequence: q has {q.shape[0]} rows "
            f"for {seq_lens.shape[0]} sequences"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if shared_prefix_len:
        check_shared_prefix(shared_prefix_len, k_cache.shape[1], block_tables, max_seq_len)
    if not triton:
        return reference_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if shared_prefix_len and q.shape[0] > 0:
        _triton_kernels("paged_cascade", q.device).launch(
            _last_dim_contiguous(q), k_cache, v_cache, _last_dim_contiguous(block_tables),
            _last_dim_contiguous(seq_lens), out, scale, shared_prefix_len, num_splits,
            max_seq_len=max_seq_len,
        )  # fmt: skip
        return out
    kernels = _triton_kernels("paged_decode", q.device)
    if q.shape[0] > 0:
        kernels.launch(
            _last_dim_contiguous(q), k_cache, v_cache, _last_dim_contiguous(block_tables),
            _last_dim_contiguous(seq_lens), out, scale, num_splits, max_seq_len=max_seq_len,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal attention of a varlen batch of new tokens over their cached contexts.

    Requires seq_lens[i] >= q_len_i (the reference checks it; the kernel cannot cheaply).
    `max_seq_len`, an upper bound of `seq_lens`, only picks the kernel's tiles.
    """
    triton = attention_backend(q.device) == "triton"
    check_attention(spec(q), spec(k_cache), spec(v_cache), triton)
    check_tables(block_tables, seq_lens, q.device)
    num_seqs = seq_lens.shape[0]
    if (
        query_start_loc.dtype != torch.int32
        or query_start_loc.shape != (num_seqs + 1,)
        or query_start_loc.device != q.device
    ):
        raise ValueError(
            f"query_start_loc must be int32 [{num_seqs + 1}] on {q.device}, got "
            f"{query_start_loc.dtype} {tuple(query_start_loc.shape)} on {query_start_loc.device}"
        )
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    if not triton:
        return reference_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    kernels = _triton_kernels("paged_prefill", q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] > 0 and num_seqs > 0:
        kernels.launch(
            _last_dim_contiguous(q), k_cache, v_cache, _last_dim_contiguous(block_tables),
            _last_dim_contiguous(seq_lens), _last_dim_contiguous(query_start_loc),
            max_query_len, out, scale, max_seq_len=max_seq_len or 0,
        )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a flat batch: the decode kernel when `meta.is_decode`, else prefill."""
    if meta.is_decode:
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
            max_seq_len=meta.max_seq_len, shared_prefix_len=meta.shared_prefix_len,
        )  # fmt: skip
    return paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_query_len, scale, max_seq_len=meta.max_seq_len,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------


def attention_backend(device: torch.device) -> Literal["triton", "torch"]:
    """The backend PAGEDQ_ATTENTION_BACKEND selects for tensors on `device`."""
    return env_backend(BACKEND_ENV, device)


def _triton_kernels(name: str, device: torch.device) -> ModuleType:
    """`triton_kernels.<name>`, imported in the Triton interpreter when run on CPU tensors."""
    companions: tuple[str, ...] = ("triton_kernels.paged_attention_common",)
    if name == "paged_cascade":
        companions += ("triton_kernels.paged_decode",)  # it launches the decode kernels too
    return load_kernels(f"triton_kernels.{name}", device, companions)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
