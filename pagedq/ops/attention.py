"""Paged attention ops: KV write, decode and prefill attention over a paged KV cache.

(Interface fixed by the engine; the implementation is being written.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    raise NotImplementedError


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:
    raise NotImplementedError


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    raise NotImplementedError


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of a flat batch: the decode kernel when `meta.is_decode`, else prefill."""
    if meta.is_decode:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    return paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.max_query_len, scale,
    )
