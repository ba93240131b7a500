"""The small per-token ops of a decoder layer, one kernel each: RMSNorm (with the residual add
before it), rotary embedding of q and k (optionally with the KV write of the same tokens:
`rotary_write_kv`), and the SiLU-gated product of gate/up.

Unfused, these are about thirty PyTorch kernels per layer, more launches than the layer's
matmuls and attention together. Each op checks its inputs (ValueError naming the mismatch),
then runs the Triton kernel (`triton_kernels/rms_norm.py`, `rotary.py`, `silu_mul.py`) or
the reference below, by PAGEDQ_FUSED_BACKEND, read per call:

  auto (default)  Triton on CUDA tensors, the reference on CPU tensors;
  triton          the Triton kernels; on CPU tensors they run in the Triton interpreter;
  torch           the reference everywhere.

The references are the model's original PyTorch code, operation for operation (and so
transformers' Llama): half-precision models round where it rounds, and the kernels round at
the same points, so the two differ only by fp32 summation order and libm.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from pagedq.ops import attention
from pagedq.ops.triton_loader import env_backend, load_kernels

BACKEND_ENV = "PAGEDQ_FUSED_BACKEND"

# ---------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight: the normalisation in fp32, the product in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def reference_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by their positions (new tensors); cos/sin rounded to q's dtype."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    cos = emb.cos().to(q.dtype).unsqueeze(1)  # [T, 1, head_dim]
    sin = emb.sin().to(q.dtype).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def reference_silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype
    """RMSNorm of every row of x."""
    _check_norm(x, weight)
    if env_backend(BACKEND_ENV, x.device) == "torch":
        return reference_rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _kernels("rms_norm", x.device).launch(_last_dim(x), weight.contiguous(), eps, out)
    return out


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # RMSNorm of the sum, and the sum
    """The residual stream after adding x (x + residual, in x's dtype) and its RMSNorm."""
    _check_norm(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
            f"{residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    if env_backend(BACKEND_ENV, x.device) == "torch":
        total = x + residual
        return reference_rms_norm(total, weight, eps), total
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _kernels("rms_norm", x.device).launch(
        _last_dim(x), weight.contiguous(), eps, out, _last_dim(residual), total
    )
    return out, total


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    inv_freq: torch.Tensor,  # [head_dim / 2] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # q and k rotated
    """Rotary embedding (half-split layout). The kernel rotates q and k in place and returns
    them; the reference returns new tensors: use the returned ones."""
    _check_rotary(positions, q, k, inv_freq)
    if env_backend(BACKEND_ENV, q.device) == "torch":
        return reference_rotary(positions, q, k, inv_freq)
    q, k = _last_dim(q), _last_dim(k)
    _kernels("rotary", q.device).launch(positions.contiguous(), q, k, inv_freq.contiguous())
    return q, k


def rotary_write_kv(
    positions: torch.Tensor,  # [num_tokens] int
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    inv_freq: torch.Tensor,  # [head_dim / 2] fp32
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int
) -> torch.Tensor:  # q rotated
    """`rotary_embedding` of q and k, then `write_kv` of the rotated k and v (a negative slot
    skips its token): one kernel when both ops run Triton, else the two ops. Returns q rotated
    (in place on the kernel path: use the returned tensor); k is rotated in place too there."""
    k_cache, v_cache = kv_cache
    fused = (
        env_backend(BACKEND_ENV, q.device) == "triton"
        and attention.attention_backend(q.device) == "triton"
    )
    if not fused:
        q, k = rotary_embedding(positions, q, k, inv_freq)
        attention.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    _check_rotary(positions, q, k, inv_freq)
    attention.check_write_kv(k, v, k_cache, v_cache, slot_mapping, triton=True)
    q, k, v = _last_dim(q), _last_dim(k), _last_dim(v)
    cache = (v, k_cache, v_cache, slot_mapping.contiguous())
    _kernels("rotary", q.device).launch(positions.contiguous(), q, k, inv_freq.contiguous(), cache)
    return q


def _check_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or (k.shape[0], k.shape[2]) != (q.shape[0], q.shape[2])  # tokens and head_dim
        or q.shape[2] % 2
    ):
        raise ValueError(
            "q and k must be [num_tokens, heads, head_dim] with the same tokens and an even "
            f"head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k ({k.dtype}, {k.device}) must match q ({q.dtype}, {q.device})")
    if positions.shape != q.shape[:1] or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer [{q.shape[0]}] tensor, got "
            f"{positions.dtype} {tuple(positions.shape)}"
        )
    if inv_freq.shape != (q.shape[2] // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(
            f"inv_freq must be fp32 [{q.shape[2] // 2}], got {inv_freq.dtype} "
            f"{tuple(inv_freq.shape)}"
        )


def silu_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * inter] -> [num_tokens, inter]
    """silu(gate) * up of a fused gate/up output x = [gate | up]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * inter], got {tuple(x.shape)}")
    if env_backend(BACKEND_ENV, x.device) == "torch":
        return reference_silu_mul(x)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _kernels("silu_mul", x.device).launch(_last_dim(x), out)
    return out


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != x.shape[1:]:
        raise ValueError(
            f"x must be [num_tokens, hidden] and weight [hidden]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if weight.device != x.device or weight.dtype != x.dtype:
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})"
        )


def _kernels(name: str, device: torch.device) -> ModuleType:
    return load_kernels(f"triton_kernels.{name}", device)


def _last_dim(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
