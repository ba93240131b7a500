"""Exp(1) noise for seeded sampling rows: one launch for every seeded row of a batch.

Algorithm: value (row r, column i) is a pure function of (seed[r], step[r], i): Philox4x32-10
with key = the seed's two 32-bit halves and counter = (i, step, 0, 0); its first word w gives
u = (w >> 8) * 2^-24 in [0, 1) (exact in fp32) and the noise -log(1 - u). So a row's draws
depend only on its own seed and its output position, not on the batch around it.
`pagedq.ops.noise.reference_seeded_exponential` is the same computation in PyTorch.

Tensor layouts:
  seeds  [rows] int64 (0 <= seed < 2^63)
  steps  [rows] int64 (0 <= step < 2^32)
  out    [rows, vocab] fp32, contiguous, written
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program
_M0, _M1 = tl.constexpr(0xD2511F53), tl.constexpr(0xCD9E8D57)  # Philox4x32 round multipliers
_W0, _W1 = tl.constexpr(0x9E3779B9), tl.constexpr(0xBB67AE85)  # Philox4x32 key increments


@triton.jit
def seeded_exponential(seed, step, cols):
    """Exp(1) noise of columns `cols` (a block of int32) for one row's (seed, step): fp32, the
    same shape as `cols`. seed: int64 scalar; step: integer scalar."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = cols.to(tl.uint32)
    c1 = tl.zeros_like(c0) + step.to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        hi1 = tl.umulhi(c2, _M1)
        lo0 = c0 * _M0
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    u = (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return -tl.log(1.0 - u)


@triton.jit
def _seeded_exponential_kernel(
    # pointers
    seeds_ptr,
    steps_ptr,
    out_ptr,
    # sizes
    VOCAB,
    # constexprs
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = seeded_exponential(tl.load(seeds_ptr + row), tl.load(steps_ptr + row), cols)
    tl.store(out_ptr + row.to(tl.int64) * VOCAB + cols, noise, mask=cols < VOCAB)


def launch(seeds: torch.Tensor, steps: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = the noise of (seeds[r], steps[r]) for every column."""
    rows, vocab = out.shape
    if rows == 0:
        return
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _seeded_exponential_kernel[grid](seeds, steps, out, vocab, BLOCK=BLOCK, num_warps=4)
