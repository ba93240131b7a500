"""Paged attention references: plain PyTorch, fp32 math; the CPU path and the test oracle.

Each function computes what the matching Triton kernel computes, in the most obvious way
(gather the pages, one dense softmax), so a test can trust it without trusting the kernels.
Tensor layouts are those of `pagedq.ops.attention`: caches `[num_blocks, block_size,
num_kv_heads, head_dim]`, query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
"""

from __future__ import annotations

import torch


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
