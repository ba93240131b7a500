"""SiLU-gated product of a fused gate/up projection: out = silu(gate) * up.

Algorithm: program (rows, tile) reads BLOCK columns of the gate half and the same columns of
the up half of ROWS rows: one row and 1024 columns, or for batches of 32 to 512 tokens a few
rows and 4096 columns, so that the grid leaves the SMs to the next matmul
(`pdl.rows_per_program`). silu(gate) is computed in fp32 and rounded to the row dtype before
the product, as the reference (and transformers) do in half precision.

Tensor layouts:
  x     [num_tokens, 2 * inter]: gate = x[:, :inter], up = x[:, inter:], last dim contiguous
  out   [num_tokens, inter], contiguous, written
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton_kernels.pdl import early_launch, launch_options, rows_per_program

BLOCK = 1024  # columns per program of one row
WIDE_BLOCK = 4096  # columns per program of several rows


@triton.jit
def _silu_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    num_tokens,
    # strides
    stride_xt,
    # constexprs
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (tokens < num_tokens)[:, None] & (offs < INTER)[None, :]  # [ROWS, BLOCK]
    at = x_ptr + tokens[:, None] * stride_xt + offs[None, :]
    gate = tl.load(at, mask=mask, other=0.0)
    up = tl.load(at + INTER, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + tokens[:, None] * INTER + offs[None, :], y.to(gate.dtype), mask=mask)


def launch(
    x: torch.Tensor,  # [num_tokens, 2 * inter], last dim contiguous
    out: torch.Tensor,  # [num_tokens, inter], contiguous, written
) -> None:
    """out = silu(x[:, :inter]) * x[:, inter:]."""
    num_tokens, inter = out.shape
    if num_tokens == 0:
        return
    rows = rows_per_program(num_tokens)
    block = BLOCK if rows == 1 else WIDE_BLOCK
    grid = (triton.cdiv(num_tokens, rows), triton.cdiv(inter, block))
    pdl = early_launch(x.device)
    _silu_mul_kernel[grid](
        x, out, num_tokens, x.stride(0), INTER=inter, BLOCK=block, ROWS=rows, PDL=pdl,
        num_warps=4 if rows == 1 else 8, **launch_options(pdl),
    )  # fmt: skip
