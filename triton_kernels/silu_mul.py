"""SiLU-gated product of a fused gate/up projection: out = silu(gate) * up.

Algorithm: program (token, tile) reads BLOCK columns of the gate half and the same columns of
the up half of its row. silu(gate) is computed in fp32 and rounded to the row dtype before
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

from triton_kernels.pdl import early_launch, launch_options

BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # strides
    stride_xt,
    # constexprs
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a dependent (triton_kernels/pdl.py)
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # nothing is read or written before the previous kernel is done
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + token * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_xt + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + token * INTER + offs, y.to(gate.dtype), mask=mask)


def launch(
    x: torch.Tensor,  # [num_tokens, 2 * inter], last dim contiguous
    out: torch.Tensor,  # [num_tokens, inter], contiguous, written
) -> None:
    """out = silu(x[:, :inter]) * x[:, inter:]."""
    num_tokens, inter = out.shape
    if num_tokens == 0:
        return
    grid = (num_tokens, triton.cdiv(inter, BLOCK))
    pdl = early_launch(x.device)
    _silu_mul_kernel[grid](
        x, out, x.stride(0), INTER=inter, BLOCK=BLOCK, PDL=pdl, num_warps=4, **launch_options(pdl)
    )
