"""Shared pieces of the GPTQ 4-bit Triton kernels: main loop over packed blocks, and the epilogue.

Algorithm: out[m, n] = sum_k x[m, k] * (q[k, n] - z[g(k), n]) * s[g(k), n] (+ bias[n]), with the
weights dequantized in registers, fp32 accumulation, and optional split-K over the input rows.

Packed weight layout (built once at load, see `pagedq.ops.gptq.PackedGPTQWeight`):

- `qweight` [Kp/8, N] int32, Kp = 128 * ceil(K / 128), input rows already sorted by group.
  Rows come in blocks of 128: block b owns word rows 16b .. 16b+15, and nibble j (bits 4j..4j+3)
  of word row 16b + r holds input row 128b + 16j + r. A [16, BLOCK_N] tile of words shifted by
  4j therefore gives 16 consecutive input rows, and stacking the 8 shifts on a new leading axis
  ([8, 16, BLOCK_N]) then reshaping gives the [128, BLOCK_N] tile in input-row order, so the
  activations are one contiguous [BLOCK_M, 128] load. Loads along N are contiguous (16 bytes
  for 4 adjacent columns), padded rows hold 0 and meet masked (zero) activations.
- `scales` / `zeros` [G, N] in the activation dtype: group g covers sorted rows
  g*GROUP .. (g+1)*GROUP-1; zeros hold z' (already +1 for v1 checkpoints) as exact small
  integers, or are absent when every z' is 8 (HAS_ZEROS=False).

Dequantization avoids int->float conversions: `q | 0x6400` read as fp16 is 1024 + q exactly
(`0x4300` in bf16 is 128 + q, `0x4B000000` in fp32 is 2**23 + q), and subtracting (MAGIC + z')
in the same dtype is exact, so one rounding (the multiply by the scale) remains.

SCALE_MODE says how often scales change inside a 128-row block: 0 once (GROUP % 128 == 0 or a
single group), 1 per 16-row slice (GROUP % 16 == 0), 2 per row (any other group size).

Split-K epilogue: with SPLIT_K > 1 every program writes its fp32 partial tile to a workspace
[SPLIT_K, M, N], then increments the tile's arrival counter in `locks`; the last program to
arrive sums the partials in split order (deterministic), writes the output and resets the
counter to 0, so `locks` is all zeros between launches and a launch is a single kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_group_params(
    scales_ptr,
    zeros_ptr,
    block,
    offs_n,  # [BLOCK_N]
    n_mask,  # [BLOCK_N]
    GROUP,
    NUM_GROUPS,
    stride_sg,
    SCALE_MODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    """Scale and zero point of every row of 128-row `block`, broadcastable to [8, 16, BLOCK_N]."""
    if SCALE_MODE == 0:
        # --- one group for the whole block: one [BLOCK_N] row of scales
        offs = (block * 128) // GROUP * stride_sg + offs_n
        s = tl.load(scales_ptr + offs, mask=n_mask, other=0.0)[None, None, :]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask, other=0.0)[None, None, :]
        else:
            z = tl.full((1, 1, 1), 8.0, dtype=s.dtype)
    elif SCALE_MODE == 1:
        # --- one group per 16-row slice j (rows 128b + 16j ..): [8, BLOCK_N]
        rows = block * 128 + tl.arange(0, 8) * 16
        g = tl.minimum(rows // GROUP, NUM_GROUPS - 1)  # padded rows clamp to the last group
        offs = g[:, None] * stride_sg + offs_n[None, :]
        s = tl.load(scales_ptr + offs, mask=n_mask[None, :], other=0.0)[:, None, :]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask[None, :], other=0.0)[:, None, :]
        else:
            z = tl.full((1, 1, 1), 8.0, dtype=s.dtype)
    else:
        # --- any group size: one lookup per row, [8, 16, BLOCK_N]
        rows = block * 128 + (tl.arange(0, 8) * 16)[:, None] + tl.arange(0, 16)[None, :]
        g = tl.minimum(rows // GROUP, NUM_GROUPS - 1)
        offs = g[:, :, None] * stride_sg + offs_n[None, None, :]
        s = tl.load(scales_ptr + offs, mask=n_mask[None, None, :], other=0.0)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask[None, None, :], other=0.0)
        else:
            z = tl.full((1, 1, 1), 8.0, dtype=s.dtype)
    return s, z


@triton.jit
def dequant_block(words, s, z):
    """words [16, BLOCK_N] int32 -> weights [128, BLOCK_N] in the dtype of `s` (rows in order)."""
    # --- unpack: [8, 16, BLOCK_N], element (j, r, n) is input row 16j + r of the block
    q = (words[None, :, :] >> (tl.arange(0, 8) * 4)[:, None, None]) & 0xF
    # --- exact small floats through the exponent trick (no int->float conversion)
    if s.dtype == tl.float16:
        qf = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
        zf = (z.to(tl.float32) + 1024.0).to(tl.float16)
    elif s.dtype == tl.bfloat16:
        qf = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
        zf = (z.to(tl.float32) + 128.0).to(tl.bfloat16)
    else:
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
        zf = z.to(tl.float32) + 8388608.0
    # --- (q - z') is exact; the scale multiply is the only rounding
    w = (qf - zf) * s
    return tl.reshape(w, (128, words.shape[1]))


@triton.jit
def accumulate_blocks(
    # pointers
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    # sizes and ranges
    offs_m,  # [BLOCK_M] row indices of x
    offs_n,  # [BLOCK_N] output columns
    M,
    N,
    K,
    GROUP,
    NUM_GROUPS,
    block_start,
    block_end,
    # strides
    stride_xm,
    stride_qk,
    stride_sg,
    # constexprs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] partial product over the 128-row blocks [block_start, block_end).

    BLOCK_M == 1 runs as a GEMV on the FMA units (a [128, BLOCK_N] fp32 accumulator reduced once
    at the end); larger BLOCK_M feed tl.dot.
    """
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, 16)
    offs_kb = tl.arange(0, 128)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    if BLOCK_M == 1:
        acc = tl.zeros((128, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(block_start, block_end):
        # --- weights: one [16, BLOCK_N] tile of packed words -> [128, BLOCK_N]
        w_offs = (block * 16 + offs_r)[:, None] * stride_qk + offs_n[None, :]
        words = tl.load(qweight_ptr + w_offs, mask=n_mask[None, :], other=0)
        s, z = load_group_params(
            scales_ptr, zeros_ptr, block, offs_n, n_mask, GROUP, NUM_GROUPS, stride_sg,
            SCALE_MODE, HAS_ZEROS,
        )  # fmt: skip
        w = dequant_block(words, s, z)
        # --- activations: contiguous [BLOCK_M, 128], zero past K (covers padded rows)
        k = block * 128 + offs_kb
        x_mask = m_mask[:, None] & (k < K)[None, :]
        xv = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * tl.reshape(xv, (128,)).to(tl.float32)[:, None]
        elif xv.dtype == tl.float32:
            acc = tl.dot(xv, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, w, acc)
    if BLOCK_M == 1:
        return tl.sum(acc, axis=0)[None, :]
    else:
        return acc


@triton.jit
def _write_output(
    acc, offs_m, offs_n, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr
):
    """acc [BLOCK_M, BLOCK_N] fp32 (+ bias) -> out in its dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_output(
    acc,  # [BLOCK_M, BLOCK_N] fp32 partial (full sum when SPLIT_K == 1)
    offs_m,
    offs_n,
    M,
    N,
    pid_k,
    tile,  # index of this output tile in `locks`
    out_ptr,
    stride_om,
    bias_ptr,
    ws_ptr,  # [SPLIT_K, M, N] fp32
    locks_ptr,
    SPLIT_K,  # number of K splits (runtime: one compiled kernel serves every split count)
    USE_SPLIT_K: tl.constexpr,  # SPLIT_K > 1
    HAS_BIAS: tl.constexpr,
):
    """Write the tile, or with split-K let the last program to arrive reduce and write it."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if not USE_SPLIT_K:
        _write_output(acc, offs_m, offs_n, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
    else:
        # --- publish this partial, then count arrivals (release/acquire at GPU scope);
        # the launcher keeps SPLIT_K * M * N below 2**31
        ws_offs = offs_m[:, None] * N + offs_n[None, :]
        plane = M * N
        tl.store(ws_ptr + pid_k * plane + ws_offs, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # --- last program: sum partials in split order, write, reset the counter
            total = tl.zeros_like(acc)
            for split in range(SPLIT_K):
                part = tl.load(
                    ws_ptr + split * plane + ws_offs, mask=mask, other=0.0, cache_modifier=".cg"
                )
                total += part
            _write_output(total, offs_m, offs_n, N, mask, out_ptr, stride_om, bias_ptr, HAS_BIAS)
            tl.atomic_xchg(locks_ptr + tile, 0)


__all__ = ["accumulate_blocks", "dequant_block", "load_group_params", "store_output"]
