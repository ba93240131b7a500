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

import functools
import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from pagedq.errors import ConfigError
from pagedq.ops.attention_reference import (
    gather_context,
    reference_decode_attention,
    reference_prefill_attention,
    reference_write_kv,
)

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

BACKEND_ENV = "PAGEDQ_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256  # widest head the kernels hold in registers (padded to a power of 2)

# (shape, strides, dtype, device) of a tensor: the cache key of its checks
_Spec = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


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
    _check_kv(_spec(k), _spec(v), _spec(k_cache), _spec(v_cache), triton)
    if (
        slot_mapping.dtype not in (torch.int64, torch.int32)
        or slot_mapping.shape != k.shape[:1]
        or slot_mapping.device != k.device
    ):
        raise ValueError(
            f"slot_mapping must be int64 [{k.shape[0]}] on {k.device}, "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}"
        )
    if not triton:
        reference_write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    kernels = _triton_kernels("kv_write", k.device)
    kernels.launch(
        _last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache,
        _last_dim_contiguous(slot_mapping),
    )  # fmt: skip


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
    _check_attention(_spec(q), _spec(k_cache), _spec(v_cache), triton)
    _check_tables(block_tables, seq_lens, q.device)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query per sequence: q has {q.shape[0]} rows "
            f"for {seq_lens.shape[0]} sequences"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if shared_prefix_len:
        _check_shared_prefix(shared_prefix_len, k_cache.shape[1], block_tables, max_seq_len)
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
    _check_attention(_spec(q), _spec(k_cache), _spec(v_cache), triton)
    _check_tables(block_tables, seq_lens, q.device)
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
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ConfigError(
            f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r} is not a backend; choose one of {BACKENDS}"
        )
    if value == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return "triton" if value == "triton" else "torch"


def _triton_kernels(name: str, device: torch.device) -> ModuleType:
    """`triton_kernels.<name>`, imported in the Triton interpreter when run on CPU tensors."""
    module_name = f"triton_kernels.{name}"
    module = sys.modules.get(module_name)
    on_cpu = device.type == "cpu"
    if module is None:
        if on_cpu:
            os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit when the module loads
        module = importlib.import_module(module_name)
    if on_cpu and not _is_interpreted(module_name):
        raise ConfigError(
            f"{module_name} was compiled for the GPU earlier in this process, so it cannot run "
            "on CPU tensors; set TRITON_INTERPRET=1 before the first kernel call"
        )
    return module


@functools.cache
def _is_interpreted(module_name: str) -> bool:
    """Whether every kernel of the module (and of the shared building blocks) is interpreted;
    fixed once the module is imported."""
    from triton.runtime.interpreter import InterpretedFunction

    names: tuple[str, ...] = (module_name, "triton_kernels.paged_attention_common")
    if module_name == "triton_kernels.paged_cascade":
        names += ("triton_kernels.paged_decode",)  # it launches the decode kernels too
    kernels = [
        obj for name in names if name in sys.modules for obj in vars(sys.modules[name]).values()
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
    ]  # fmt: skip
    return all(isinstance(fn, InterpretedFunction) for fn in kernels)


# ---------------------------------------------------------------------------------------
# input checks: shapes, dtypes, devices and strides, never tensor values. Those of q, k and
# the caches are cached per _Spec (an invalid input raises and is not cached).
# ---------------------------------------------------------------------------------------


def _spec(t: torch.Tensor) -> _Spec:
    return (t.shape, t.stride(), t.dtype, t.device)


@functools.lru_cache(maxsize=256)
def _check_attention(q: _Spec, k_cache: _Spec, v_cache: _Spec, triton: bool) -> None:
    _check_cache(k_cache, v_cache, q[2], q[3], triton)
    q_shape, cache_shape = q[0], k_cache[0]
    if len(q_shape) != 3 or q_shape[2] != cache_shape[3]:
        raise ValueError(
            f"q must be [num_tokens, num_heads, {cache_shape[3]}] (the cache's head_dim), "
            f"got {tuple(q_shape)}"
        )
    if q_shape[1] % cache_shape[2] != 0:
        raise ValueError(
            f"num_heads {q_shape[1]} is not a multiple of num_kv_heads {cache_shape[2]}"
        )


@functools.lru_cache(maxsize=256)
def _check_kv(k: _Spec, v: _Spec, k_cache: _Spec, v_cache: _Spec, triton: bool) -> None:
    _check_cache(k_cache, v_cache, k[2], k[3], triton)
    cache_shape = k_cache[0]
    if len(k[0]) != 3 or v[0] != k[0] or tuple(k[0][1:]) != tuple(cache_shape[2:]):
        raise ValueError(
            f"k and v must both be [num_tokens, {cache_shape[2]}, {cache_shape[3]}] "
            f"to match the cache; got k {tuple(k[0])}, v {tuple(v[0])}"
        )
    if v[2:] != k[2:]:
        raise ValueError(f"v ({v[2]}, {v[3]}) must match k ({k[2]}, {k[3]})")


def _check_cache(
    k_cache: _Spec, v_cache: _Spec, dtype: torch.dtype, device: torch.device, triton: bool
) -> None:
    shape = k_cache[0]
    if len(shape) != 4 or v_cache[0] != shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(shape)} and {tuple(v_cache[0])}"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {_DTYPES}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache[2:] != (dtype, device):
            raise ValueError(
                f"{name} is {cache[2]} on {cache[3]}, the inputs are {dtype} on {device}"
            )
    if not triton:
        return
    if shape[3] > MAX_TRITON_HEAD_DIM:
        raise ValueError(
            f"head_dim {shape[3]} exceeds the Triton kernels' limit {MAX_TRITON_HEAD_DIM}; "
            f"use {BACKEND_ENV}=torch"
        )
    if k_cache[1][3] != 1 or v_cache[1] != k_cache[1]:
        raise ValueError(
            "k_cache and v_cache must share strides with a contiguous head_dim, got "
            f"{k_cache[1]} and {v_cache[1]}"
        )


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, device: torch.device) -> None:
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks], "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(
            f"seq_lens must be int32 [{block_tables.shape[0]}] (one per block-table row), "
            f"got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if block_tables.device != device or seq_lens.device != device:
        raise ValueError(
            f"block_tables ({block_tables.device}) and seq_lens ({seq_lens.device}) "
            f"must be on q's device {device}"
        )


def _check_shared_prefix(
    shared_prefix_len: int, block_size: int, block_tables: torch.Tensor, max_seq_len: int | None
) -> None:
    """Shapes and ints only: the promise about table and length values is the caller's."""
    capacity = block_tables.shape[1] * block_size
    if shared_prefix_len < 0 or shared_prefix_len % block_size:
        raise ValueError(
            f"shared_prefix_len must be a non-negative multiple of the block size {block_size}, "
            f"got {shared_prefix_len}"
        )
    if shared_prefix_len >= capacity:
        raise ValueError(
            f"shared_prefix_len {shared_prefix_len} leaves no own token in block tables of "
            f"{block_tables.shape[1]} blocks ({capacity} tokens)"
        )
    if max_seq_len is not None and max_seq_len <= shared_prefix_len:
        raise ValueError(
            f"shared_prefix_len {shared_prefix_len} must be below every seq_len, but "
            f"max_seq_len is {max_seq_len}"
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
