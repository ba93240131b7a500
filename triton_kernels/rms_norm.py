"""RMSNorm, optionally after adding the residual stream: y = x / rms(x) * weight.

Algorithm: one program per token holds its whole row (hidden padded to a power of two). With a
residual, the row is first replaced by x + residual, rounded to the row dtype and stored as the
new residual stream; the norm is taken of that rounded sum. The mean of squares is fp32; the
normalised row is rounded to the row dtype before the weight product, as the reference does.

Tensor layouts:
  x, residual         [num_tokens, hidden], last dim contiguous
  weight              [hidden]
  out, residual_out   [num_tokens, hidden], contiguous, written

No tunables beyond the warp count: the op is bound by memory and launch latency.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.pdl import early_launch, launch_options


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    # sizes
    eps,
    # strides
    stride_xt,
    stride_rt,
    # constexprs
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    # every load goes out before the first store (loads are not moved past stores)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)

    # -- the row, plus the residual stream (stored back rounded) ---------------------------
    x = tl.load(x_ptr + token * stride_xt + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + token * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + token * HIDDEN + offs, x, mask=mask)

    # -- normalise in fp32, round, then scale by the weight --------------------------------
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _constants(hidden: int, has_residual: bool) -> dict[str, int]:
    block = triton.next_power_of_2(hidden)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return {"HIDDEN": hidden, "BLOCK": block, "HAS_RESIDUAL": has_residual, "num_warps": warps}


def launch(
    x: torch.Tensor,  # [num_tokens, hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden], contiguous
    eps: float,
    out: torch.Tensor,  # [num_tokens, hidden], contiguous, written
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], last dim contiguous
    residual_out: torch.Tensor | None = None,  # [num_tokens, hidden], contiguous, written
) -> None:
    """out = rms_norm(x (+ residual)) * weight; residual_out = x + residual when given."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    has_residual, pdl = residual is not None, early_launch(x.device)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if has_residual else x, weight, out,
        residual_out if residual_out is not None else out,
        eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        PDL=pdl, **_constants(hidden, has_residual), **launch_options(pdl),
    )  # fmt: skip
