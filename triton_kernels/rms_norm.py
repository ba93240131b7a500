"""RMSNorm, optionally after adding the residual stream: y = x / rms(x) * weight.

Algorithm: one program holds ROWS whole rows (hidden padded to a power of two): one row, or a
few for batches of 32 to 512 tokens, so that the grid leaves the SMs to the next matmul
(`pdl.rows_per_program`). With a residual, each row is first replaced by x + residual, rounded
to the row dtype and stored as the new residual stream; the norm is taken of that rounded sum.
The mean of squares is fp32; the normalised row is rounded to the row dtype before the weight
product, as the reference does.

Tensor layouts:
  x, residual         [num_tokens, hidden], last dim contiguous
  weight              [hidden]
  out, residual_out   [num_tokens, hidden], contiguous, written

The op is bound by memory and launch latency; its tunables are the warp count and the rows
per program.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.pdl import early_launch, launch_options, rows_per_program


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    # sizes
    num_tokens,
    eps,
    # strides
    stride_xt,
    stride_rt,
    # constexprs
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    offs = tl.arange(0, BLOCK)
    col_ok = offs < HIDDEN
    mask = (tokens < num_tokens)[:, None] & col_ok[None, :]  # [ROWS, BLOCK]
    # every load goes out before the first store (loads are not moved past stores)
    w = tl.load(weight_ptr + offs, mask=col_ok, other=0.0)[None, :]

    # -- the rows, plus the residual stream (stored back rounded) --------------------------
    x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + tokens[:, None] * stride_rt + offs[None, :], mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + tokens[:, None] * HIDDEN + offs[None, :], x, mask=mask)

    # -- normalise in fp32, round, then scale by the weight --------------------------------
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / HIDDEN + eps)  # [ROWS]
    normed = (x32 * rstd[:, None]).to(x.dtype)
    y = normed.to(tl.float32) * w.to(tl.float32)
    out_at = out_ptr + tokens[:, None] * HIDDEN + offs[None, :]
    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=64)
def _constants(hidden: int, has_residual: bool, rows: int) -> dict[str, int]:
    block = triton.next_power_of_2(hidden)
    size = block * rows
    warps = 4 if size <= 2048 else 8 if size <= 8192 else 16
    return {
        "HIDDEN": hidden, "BLOCK": block, "ROWS": rows, "HAS_RESIDUAL": has_residual,
        "num_warps": warps,
    }  # fmt: skip


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
    rows = rows_per_program(num_tokens)
    _rms_norm_kernel[(triton.cdiv(num_tokens, rows),)](
        x, residual if has_residual else x, weight, out,
        residual_out if residual_out is not None else out,
        num_tokens, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        PDL=pdl, **_constants(hidden, has_residual, rows), **launch_options(pdl),
    )  # fmt: skip
