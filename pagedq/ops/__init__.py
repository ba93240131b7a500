"""Typed launchers of every kernel, and the pure-PyTorch reference of each op.

The references are the CPU path and the test oracle; on CUDA the launchers pick the
Triton (or CUDA extension) kernels. Backends are chosen per call from environment
variables, so nothing runs at import.
"""

from pagedq.ops.attention import (
    AttentionMetadata,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

__all__ = [
    "AttentionMetadata",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
]
