"""Input checks of the paged attention ops: shapes, dtypes, devices and strides, never tensor
values (no host sync). Each raises ValueError naming the mismatch and the expected layout.

The checks of q, k and the caches (stable for a model) are cached per `Spec`; an invalid input
raises and is not cached. Block tables and lengths, which change every step, get a few cheap
comparisons per call.
"""

from __future__ import annotations

import functools

import torch

BACKEND_ENV = "PAGEDQ_ATTENTION_BACKEND"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TRITON_HEAD_DIM = 256  # widest head the kernels hold in registers (padded to a power of 2)

# (shape, strides, dtype, device) of a tensor: the cache key of its checks
Spec = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


def spec(t: torch.Tensor) -> Spec:
    return (t.shape, t.stride(), t.dtype, t.device)


@functools.lru_cache(maxsize=256)
def check_attention(q: Spec, k_cache: Spec, v_cache: Spec, triton: bool) -> None:
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
def check_kv(k: Spec, v: Spec, k_cache: Spec, v_cache: Spec, triton: bool) -> None:
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
    k_cache: Spec, v_cache: Spec, dtype: torch.dtype, device: torch.device, triton: bool
) -> None:
    shape = k_cache[0]
    if len(shape) != 4 or v_cache[0] != shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(shape)} and {tuple(v_cache[0])}"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {DTYPES}")
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


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, device: torch.device) -> None:
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


def check_shared_prefix(
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
