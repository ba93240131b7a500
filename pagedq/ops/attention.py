"""Paged attention ops: KV write, decode and prefill attention over a paged KV cache.

Each op checks its inputs (ValueError naming the mismatch), then runs either the Triton
kernels (`triton_kernels/`) or the plain-PyTorch reference defined at the end of this file.
The backend is read per call from PAGEDQ_ATTENTION_BACKEND:

  auto (default)  Triton on CUDA tensors, the reference on CPU tensors;
  triton          the Triton kernels; on CPU tensors they run in the Triton interpreter
                  (TRITON_INTERPRET=1 is set before the kernel module is first imported);
  torch           the reference everywhere.

The Triton launchers never read tensor values on the host and compile one variant per
(dtype, head_dim, GQA group, block_size) plus split/no-split, so a decode step can be
captured in a CUDA graph. The decode split count depends only on shapes and on the
`max_seq_len` bound; splits are cut per sequence on the device, so a bound that is too
small or too large costs speed, never correctness.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from pagedq.errors import ConfigError

BACKEND_ENV = "PAGEDQ_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256  # widest head the kernels hold in registers (padded to a power of 2)


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
    _check_cache(k_cache, v_cache, k.dtype, k.device)
    if k.dim() != 3 or v.shape != k.shape or tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"k and v must both be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] "
            f"to match the cache; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v ({v.dtype}, {v.device}) must match k ({k.dtype}, {k.device})")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"slot_mapping must be int64 [{k.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if attention_backend(k.device) == "torch":
        reference_write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    _check_triton_cache(k_cache, v_cache)
    kernels = _triton_kernels("kv_write", k.device)
    kernels.launch(_last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache, slot_mapping)


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
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q's dtype
    """Attention of one new query token per sequence over its whole cached context.

    `max_seq_len` is an upper bound of `seq_lens` used only to pick the split count (default:
    the block-table capacity); `num_splits` forces the split count (1: no split-K).
    A sequence with seq_len 0 gets an all-zero output.
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query per sequence: q has {q.shape[0]} rows "
            f"for {seq_lens.shape[0]} sequences"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if attention_backend(q.device) == "torch":
        return reference_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    _check_triton_cache(k_cache, v_cache)
    kernels = _triton_kernels("paged_decode", q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        num_splits = kernels.choose_num_splits(q.shape[0], k_cache.shape[2], bound, q.device)
    kernels.launch(
        _last_dim_contiguous(q), k_cache, v_cache, block_tables, seq_lens, out, scale, num_splits
    )
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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal attention of a varlen batch of new tokens over their cached contexts.

    Requires seq_lens[i] >= q_len_i (the reference checks it; the kernel cannot cheaply).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(
            f"query_start_loc must be int32 [{num_seqs + 1}], "
            f"got {query_start_loc.dtype} {tuple(query_start_loc.shape)}"
        )
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    if attention_backend(q.device) == "torch":
        return reference_prefill_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    _check_triton_cache(k_cache, v_cache)
    kernels = _triton_kernels("paged_prefill", q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    kernels.launch(
        _last_dim_contiguous(q), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        max_query_len, out, scale,
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
            max_seq_len=meta.max_seq_len,
        )  # fmt: skip
    return paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_query_len, scale,
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
    """Import `triton_kernels.<name>`, in the Triton interpreter when run on CPU tensors."""
    module_name = f"triton_kernels.{name}"
    on_cpu = device.type == "cpu"
    if on_cpu and module_name not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit when the module is imported
    module = importlib.import_module(module_name)
    if on_cpu and not _is_interpreted(module):
        raise ConfigError(
            f"{module_name} was compiled for the GPU earlier in this process, so it cannot run "
            "on CPU tensors; set TRITON_INTERPRET=1 before the first kernel call"
        )
    return module


def _is_interpreted(module: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    modules = [module, sys.modules.get("triton_kernels.paged_attention_common")]
    kernels = [
        obj for mod in modules if mod is not None for obj in vars(mod).values()
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
    ]  # fmt: skip
    return all(isinstance(fn, InterpretedFunction) for fn in kernels)


# ---------------------------------------------------------------------------------------
# input checks (cheap: shapes, dtypes, devices; never tensor values)
# ---------------------------------------------------------------------------------------


def _check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {_DTYPES}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != dtype or cache.device != device:
            raise ValueError(
                f"{name} is {cache.dtype} on {cache.device}, the inputs are {dtype} on {device}"
            )


def _check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    _check_cache(k_cache, v_cache, q.dtype, q.device)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"q must be [num_tokens, num_heads, {k_cache.shape[3]}] (the cache's head_dim), "
            f"got {tuple(q.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}"
        )
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [num_seqs, max_blocks], "
            f"got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (block_tables.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens must be int32 [{block_tables.shape[0]}] (one per block-table row), "
            f"got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if block_tables.device != q.device or seq_lens.device != q.device:
        raise ValueError(
            f"block_tables ({block_tables.device}) and seq_lens ({seq_lens.device}) "
            f"must be on q's device {q.device}"
        )


def _check_triton_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = k_cache.shape[3]
    if head_dim > MAX_TRITON_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} exceeds the Triton kernels' limit {MAX_TRITON_HEAD_DIM}; "
            f"use {BACKEND_ENV}=torch"
        )
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(
            "k_cache and v_cache must share strides with a contiguous head_dim, got "
            f"{k_cache.stride()} and {v_cache.stride()}"
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------
# references: plain PyTorch, fp32 math; the CPU path and the test oracle
# ---------------------------------------------------------------------------------------


def reference_write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens], negative = skip
) -> None:
    """Scatter by slot: token t goes to page slot // block_size, row slot % block_size."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32, one sequence's row
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """The first `seq_len` cached tokens of one sequence, in order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    if num_blocks > block_table.shape[0]:
        raise ValueError(
            f"seq_len {seq_len} needs {num_blocks} blocks, the block table holds "
            f"{block_table.shape[0]}"
        )
    pages = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kv_heads, D]
    return pages.flatten(0, 1)[:seq_len]


def reference_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query per sequence attending to all its seq_len cached tokens (batched, masked)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max()) if num_seqs else 0
    num_blocks = -(-max_len // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(
            f"seq_len {max_len} needs {num_blocks} blocks, the block tables hold "
            f"{block_tables.shape[1]}"
        )
    pages = block_tables[:, :num_blocks].long()  # [num_seqs, num_blocks]
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [S, L]
    # slots past a sequence's length may hold anything (even NaN): zero them before use
    hidden = ~valid[:, :, None, None]
    k = k_cache[pages].flatten(1, 2)[:, :max_len].float().masked_fill(hidden, 0.0)
    v = v_cache[pages].flatten(1, 2)[:, :max_len].float().masked_fill(hidden, 0.0)
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", qg, k) * scale  # [num_seqs, kv_heads, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgl,slkd->skgd", probs, v).reshape(num_seqs, num_heads, head_dim)
    out = torch.where((seq_lens > 0)[:, None, None], out, 0.0)  # empty context: zeros
    return out.to(q.dtype)


def reference_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Per sequence: gather its context, causal attention of its last q_len positions."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        if seq_len < q_len:
            raise ValueError(f"sequence {i}: seq_len {seq_len} is shorter than its {q_len} queries")
        k = gather_context(k_cache, block_tables[i], seq_len).float()  # [L, kv_heads, D]
        v = gather_context(v_cache, block_tables[i], seq_len).float()
        out[starts[i] : starts[i + 1]] = _causal_attention(
            q[starts[i] : starts[i + 1]], k, v, scale
        )
    return out


def _causal_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: positions L-n .. L-1
    k: torch.Tensor,  # [L, num_kv_heads, head_dim] fp32
    v: torch.Tensor,  # [L, num_kv_heads, head_dim] fp32
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim], q's dtype
    n, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = k.shape[0], k.shape[1]
    qg = q.float().view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("nkgd,lkd->kgnl", qg, k) * scale  # [kv_heads, G, n, L]
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("kgnl,lkd->nkgd", probs, v)
    return out.reshape(n, num_heads, head_dim).to(q.dtype)
