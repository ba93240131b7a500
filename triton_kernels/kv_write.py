"""KV write: scatter the new tokens' K and V into their cache pages by slot_mapping.

Algorithm: one program per new token; it reads the token's slot
(`block_id * block_size + offset`) and copies its [num_kv_heads, head_dim] K and V rows
into page `block_id`, row `offset`. A negative slot means "skip this token" (padding rows
of a captured batch): nothing is written for it.

Tensor layouts:
  k, v          [num_tokens, num_kv_heads, head_dim]
  k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim], same strides
  slot_mapping  [num_tokens] int64 (int32 accepted)

No tunables beyond the padded tile; the copy is bound by memory and launch latency.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.pdl import early_launch, launch_options


@triton.jit
def _kv_write_kernel(
    # pointers
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    # strides
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (k_cache and v_cache share them)
    stride_ct,
    stride_ch,
    # constexprs
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # -- the token's [H_PAD, D_PAD] tile, padding masked ----------------------------------
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    tok = token.to(tl.int64)
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)

    # -- store into page block_id, row offset ----------------------------------------------
    dst = block_id * stride_cb + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@functools.lru_cache(maxsize=64)
def _constants(num_kv_heads: int, head_dim: int, block_size: int) -> dict[str, int]:
    h_pad, d_pad = 1 << (num_kv_heads - 1).bit_length(), 1 << (head_dim - 1).bit_length()
    return {
        "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim, "H_PAD": h_pad, "D_PAD": d_pad,
        "BLOCK_SIZE": block_size, "num_warps": 4 if h_pad * d_pad <= 2048 else 8,
    }  # fmt: skip


def launch(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    slot_mapping: torch.Tensor,  # [num_tokens], contiguous
) -> None:
    """Scatter k and v into the caches (in place)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    pdl = early_launch(k.device)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PDL=pdl, **_constants(num_kv_heads, head_dim, k_cache.shape[1]), **launch_options(pdl),
    )  # fmt: skip
