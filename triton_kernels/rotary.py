"""Rotary position embedding of q and k, in place (half-split layout, as HF Llama), and
optionally the KV write of the same tokens.

Algorithm: one program per token computes the angles position * inv_freq in fp32, their cos
and sin rounded to the tensors' dtype (as the reference and transformers round them), and
rotates every head of its q and k row: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for the
two halves x1, x2 of a head, in fp32 with one rounding. With CACHE, the program then stores
the rotated k row and the v row into their cache page at the token's slot (block_id *
block_size + offset; a negative slot writes nothing), as triton_kernels/kv_write.py does: one
launch instead of two per layer.

Tensor layouts:
  q             [num_tokens, num_heads, head_dim], last dim contiguous (a view of the qkv output)
  k, v          [num_tokens, num_kv_heads, head_dim], last dim contiguous
  positions     [num_tokens] int
  inv_freq      [head_dim / 2] fp32
  k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim], same strides (CACHE only)
  slot_mapping  [num_tokens] int (CACHE only)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.pdl import early_launch, launch_options


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The two halves of a [heads, head_dim] row rotated, in fp32 with one rounding."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def _rotary_kernel(
    # pointers
    q_ptr,
    k_ptr,
    positions_ptr,
    inv_freq_ptr,
    v_ptr,  # CACHE only (the rest: unused placeholders otherwise)
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    # strides
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (k_cache and v_cache share them)
    stride_ct,
    stride_ch,
    # constexprs
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    CACHE: tl.constexpr = False,  # also write k and v into the caches
    BLOCK_SIZE: tl.constexpr = 1,  # cache page size (CACHE only)
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    offs_h = tl.arange(0, H_PAD)
    d_ok = offs_d[None, :] < HALF
    q_mask = (offs_h[:, None] < NUM_HEADS) & d_ok
    k_mask = (offs_h[:, None] < NUM_KV_HEADS) & d_ok

    # -- every load before the first store (loads are not moved past stores) ---------------
    inv = tl.load(inv_freq_ptr + offs_d, mask=offs_d < HALF, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv
    q_at = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    k_at = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    q1, q2 = tl.load(q_at, mask=q_mask, other=0.0), tl.load(q_at + HALF, mask=q_mask, other=0.0)
    k1, k2 = tl.load(k_at, mask=k_mask, other=0.0), tl.load(k_at + HALF, mask=k_mask, other=0.0)
    if CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        v_at = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        v1, v2 = tl.load(v_at, mask=k_mask), tl.load(v_at + HALF, mask=k_mask)

    # -- the token's angles: cos and sin rounded to q's dtype; q and k rotated in place ------
    dtype = q_ptr.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(dtype).to(tl.float32)[None, :]
    q1, q2 = _rotate(q1, q2, cos, sin)
    tl.store(q_at, q1, mask=q_mask)
    tl.store(q_at + HALF, q2, mask=q_mask)
    k1, k2 = _rotate(k1, k2, cos, sin)
    tl.store(k_at, k1, mask=k_mask)
    tl.store(k_at + HALF, k2, mask=k_mask)

    # -- the rotated k row and the v row into page block_id, row offset ---------------------
    if CACHE:  # noqa: SIM102 (slot exists only under the constexpr branch)
        if slot >= 0:  # a negative slot (a padding row) writes nothing
            at = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
            dst = at + offs_h[:, None] * stride_ch + offs_d[None, :]
            tl.store(k_cache_ptr + dst, k1, mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF, k2, mask=k_mask)
            tl.store(v_cache_ptr + dst, v1, mask=k_mask)
            tl.store(v_cache_ptr + dst + HALF, v2, mask=k_mask)


@functools.lru_cache(maxsize=64)
def _constants(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    h_pad, half_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim // 2)
    return {
        "NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads, "HALF": head_dim // 2,
        "H_PAD": h_pad, "HALF_PAD": half_pad, "num_warps": 4 if h_pad * half_pad <= 2048 else 8,
    }  # fmt: skip


def launch(
    positions: torch.Tensor,  # [num_tokens] int, contiguous
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous, rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous, in place
    inv_freq: torch.Tensor,  # [head_dim / 2] fp32, contiguous
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate q and k in place by their tokens' positions; with `cache` = (v, k_cache,
    v_cache, slot_mapping), also write the rotated k and v into the caches (in place)."""
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    pdl = early_launch(q.device)
    if cache is None:
        v, k_cache, v_cache, slots = k, k, k, positions  # placeholders, never read
        cache_strides: tuple[int, ...] = (0,) * 5
        extra = {}
    else:
        v, k_cache, v_cache, slots = cache
        cache_strides = (v.stride(0), v.stride(1), *k_cache.stride()[:3])
        extra = {"CACHE": True, "BLOCK_SIZE": k_cache.shape[1]}
    _rotary_kernel[(num_tokens,)](
        q, k, positions, inv_freq, v, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *cache_strides,
        PDL=pdl, **_constants(num_heads, k.shape[1], head_dim), **extra, **launch_options(pdl),
    )  # fmt: skip
