"""Shared pieces of the GPTQ 4-bit Triton kernels: main loop over packed blocks, and the epilogue.

Algorithm: out[m, n] = sum_k x[m, k] * (q[k, n] - z[g(k), n]) * s[g(k), n] (+ bias[n]), with the
weights dequantized in registers, fp32 accumulation, and optional split-K over the input rows.

Packed weight layout (built once at load, see `pagedq.ops.gptq.PackedGPTQWeight`):

- `qweight` [Kp/8, N] int32, Kp = 128 * ceil(K / 128), input rows already sorted by group.
  Rows come in blocks of 128: block b owns word rows 16b .. 16b+15, and nibble p + 4h
  (p = 0..3, h = 0..1; bits 4p + 16h ..) of word row 16b + r holds input row
  128b + 32p + 2r + h. So `(word >> 4p) & 0x000F000F` holds rows (32p + 2r, 32p + 2r + 1) in
  its two 16-bit halves: the (k, k+1) pair that a tensor-core B fragment keeps in one register,
  and `| 0x6400_6400` turns it into two fp16 values without a single per-nibble operation. The
  [16, BLOCK_N] word tile becomes [4, 16, 2, BLOCK_N] (p, r, h, n) and reshapes to the
  [128, BLOCK_N] tile in input-row order, so the activations are one contiguous
  [BLOCK_M, 128] load. Loads along N are contiguous (16 bytes for 4 adjacent columns); padded
  rows hold 0 and meet masked (zero) activations.
- `scales` / `zeros` [G, N] in the activation dtype: group g covers sorted rows
  g*GROUP .. (g+1)*GROUP-1; zeros hold z' (already +1 for v1 checkpoints) as exact small
  integers, or are absent when every z' is 8 (HAS_ZEROS=False).

Dequantization avoids int->float conversions: a nibble OR 0x6400 read as fp16 is 1024 + q
exactly (0x4300 in bf16 is 128 + q, 0x4B000000 in fp32 is 2**23 + q), and subtracting
(MAGIC + z') in the same dtype is exact. SCALE_MODE says how often scales change inside a
128-row block: 0 never (GROUP % 128 == 0 or a single group), 1 per 32-row quarter p
(GROUP % 32 == 0), 2 per row (any other group size). In mode 0 with BLOCK_M <= 32 the dot runs
on the exact integers (q - z') and its fp32 result is scaled once per block (no rounding);
otherwise the weights are multiplied by their scale before the dot (one rounding).

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
    """Scale and zero point of every row of 128-row `block`, broadcastable to [4, 16, 2, BLOCK_N]
    (the (p, r, h, n) order of `dequant_block`: row 32p + 2r + h)."""
    if SCALE_MODE == 0:
        # --- one group for the whole block: one [BLOCK_N] row
        offs = tl.minimum((block * 128) // GROUP, NUM_GROUPS - 1) * stride_sg + offs_n
        s = tl.load(scales_ptr + offs, mask=n_mask, other=0.0)[None, None, None, :]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask, other=0.0)[None, None, None, :]
        else:
            z = tl.full((1, 1, 1, 1), 8.0, dtype=s.dtype)
    elif SCALE_MODE == 1:
        # --- one group per 32-row quarter p (rows 128b + 32p ..): [4, BLOCK_N]
        rows = block * 128 + tl.arange(0, 4) * 32
        g = tl.minimum(rows // GROUP, NUM_GROUPS - 1)  # padded rows clamp to the last group
        offs = g[:, None] * stride_sg + offs_n[None, :]
        s = tl.load(scales_ptr + offs, mask=n_mask[None, :], other=0.0)[:, None, None, :]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask[None, :], other=0.0)[:, None, None, :]
        else:
            z = tl.full((1, 1, 1, 1), 8.0, dtype=s.dtype)
    else:
        # --- any group size: one lookup per row, [128, BLOCK_N] -> [4, 16, 2, BLOCK_N]
        rows = block * 128 + tl.arange(0, 128)
        g = tl.minimum(rows // GROUP, NUM_GROUPS - 1)
        offs = g[:, None] * stride_sg + offs_n[None, :]
        s = tl.load(scales_ptr + offs, mask=n_mask[None, :], other=0.0)
        s = tl.reshape(s, (4, 16, 2, offs_n.shape[0]))
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs, mask=n_mask[None, :], other=0.0)
            z = tl.reshape(z, (4, 16, 2, offs_n.shape[0]))
        else:
            z = tl.full((1, 1, 1, 1), 8.0, dtype=s.dtype)
    return s, z


@triton.jit
def _unpack_pairs(words, dtype: tl.constexpr):
    """words [16, BLOCK_N] int32 -> (lo, hi) [4, 16, BLOCK_N] in dtype: MAGIC + q of rows
    32p + 2r (lo) and 32p + 2r + 1 (hi), exactly."""
    shifts = (tl.arange(0, 4) * 4)[:, None, None]
    if dtype == tl.float16:
        pairs = ((words[None, :, :] >> shifts) & 0x000F000F) | 0x64006400  # fp16 (1024 + q) x 2
        lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    elif dtype == tl.bfloat16:
        pairs = ((words[None, :, :] >> shifts) & 0x000F000F) | 0x43004300  # bf16 (128 + q) x 2
        lo = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        lo = (((words[None, :, :] >> shifts) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        hi = (((words[None, :, :] >> (shifts + 16)) & 0xF) | 0x4B000000).to(
            tl.float32, bitcast=True
        )
    return lo, hi


@triton.jit
def _halves(t):
    """Group params [P, R, H, BLOCK_N] (P in {1, 4}, R in {1, 16}, H in {1, 2}) -> their (h = 0,
    h = 1) parts as [P, R, BLOCK_N], to meet the (p, r, n) nibble pairs before they are joined."""
    if t.shape[2] == 1:
        flat = tl.reshape(t, (t.shape[0], t.shape[1], t.shape[3]))
        return flat, flat
    else:
        return tl.split(tl.permute(t, (0, 1, 3, 2)))


@triton.jit
def dequant_block(words, s, z, APPLY_SCALE: tl.constexpr):
    """words [16, BLOCK_N] int32 -> [128, BLOCK_N] in the dtype of `s`, rows in order:
    (q - z') * s with APPLY_SCALE, else the exact integers q - z'.

    Zeros and scales meet the (p, r, n) pairs before the join: broadcasting them after it, in the
    [4, 16, 2, BLOCK_N] order, made Triton move every dequantized value through shared memory
    to reach tl.dot's register layout (sm_90)."""
    # --- unpack: (p, r, n) pairs, MAGIC + q of rows 32p + 2r (lo) and 32p + 2r + 1 (hi)
    lo, hi = _unpack_pairs(words, s.dtype)
    # --- subtract MAGIC + z' (exact), then scale (the only rounding)
    if s.dtype == tl.float16:
        zf = (z.to(tl.float32) + 1024.0).to(tl.float16)
    elif s.dtype == tl.bfloat16:
        zf = (z.to(tl.float32) + 128.0).to(tl.bfloat16)
    else:
        zf = z.to(tl.float32) + 8388608.0
    z_lo, z_hi = _halves(zf)
    lo = lo - z_lo
    hi = hi - z_hi
    if APPLY_SCALE:
        s_lo, s_hi = _halves(s)
        lo = lo * s_lo
        hi = hi * s_hi
    # --- [4, 16, 2, BLOCK_N], element (p, r, h, n) = row 32p + 2r + h
    w = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))
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
    SWAP_AB: tl.constexpr = False,  # compute out^T = W x^T: the dequantized weights are the A
):
    """fp32 [BLOCK_M, BLOCK_N] partial product over the 128-row blocks [block_start, block_end).

    SWAP_AB: the products are formed as out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, 128] x^T, so the
    weights dequantized in registers are tl.dot's first operand (which Hopper's wgmma can take
    from registers; the second operand must sit in shared memory) and the activation tile is
    the second, read transposed; the result is transposed once at the end."""
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, 16)
    offs_kb = tl.arange(0, 128)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    # one group per block: the dot runs on the exact integers q - z' and its fp32 sums are
    # scaled once (exact). With the weights as the first operand this beat pre-scaled weights at
    # every M on the H200 (M=64 stack 3.37 vs 3.46 ms); unswapped, only small tiles win
    POST_SCALE: tl.constexpr = SCALE_MODE == 0 and (SWAP_AB or BLOCK_M <= 32)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # group parameters are fetched one block ahead: their load is off the loop's critical path
    # (the pipeliner only prefetches the weight and activation tiles)
    s_next, z_next = load_group_params(
        scales_ptr, zeros_ptr, block_start, offs_n, n_mask, GROUP, NUM_GROUPS, stride_sg,
        SCALE_MODE, HAS_ZEROS,
    )  # fmt: skip
    for block in range(block_start, block_end):
        # --- weights: one [16, BLOCK_N] tile of packed words -> [128, BLOCK_N]
        w_offs = (block * 16 + offs_r)[:, None] * stride_qk + offs_n[None, :]
        words = tl.load(qweight_ptr + w_offs, mask=n_mask[None, :], other=0)
        s, z = s_next, z_next
        s_next, z_next = load_group_params(
            scales_ptr, zeros_ptr, tl.minimum(block + 1, block_end - 1), offs_n, n_mask, GROUP,
            NUM_GROUPS, stride_sg, SCALE_MODE, HAS_ZEROS,
        )  # fmt: skip
        w = dequant_block(words, s, z, not POST_SCALE)
        # --- activations: contiguous [BLOCK_M, 128], zero past K (covers padded rows)
        k = block * 128 + offs_kb
        x_mask = m_mask[:, None] & (k < K)[None, :]
        xv = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        # --- tensor cores; with POST_SCALE the exact integer product is scaled once per block
        if SWAP_AB:
            if POST_SCALE:
                part = _dot(tl.trans(w), tl.trans(xv), tl.zeros_like(acc))
                acc += part * tl.reshape(s, (BLOCK_N, 1)).to(tl.float32)
            else:
                acc = _dot(tl.trans(w), tl.trans(xv), acc)
        elif POST_SCALE:
            part = _dot(xv, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
            acc += part * tl.reshape(s, (1, BLOCK_N)).to(tl.float32)
        else:
            acc = _dot(xv, w, acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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


__all__ = [
    "accumulate_blocks",
    "dequant_block",
    "load_group_params",
    "store_output",
]
