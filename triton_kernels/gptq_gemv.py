"""GPTQ 4-bit matmul for small batches (M <= 16): split-K GEMV on packed blocks.

Algorithm: program (pid_n, pid_k) owns output columns [pid_n * BLOCK_N, +BLOCK_N) and the
128-row input blocks [pid_k * BLOCKS_PER_SPLIT, +BLOCKS_PER_SPLIT). It streams the packed
weights of that slab once (16-byte loads along N), dequantizes them in registers
(`gptq_common.dequant_block`) and feeds tl.dot with a 16-row activation tile (rows past M are
masked to zero: tensor cores have cycles to spare at small M, the dequantization does not),
accumulating in fp32. Narrow layers split K so that the grid fills the
GPU; the last program of each column tile reduces the partials (`gptq_common.store_output`).

Layouts (see `gptq_common` and `pagedq.ops.gptq.PackedGPTQWeight`):
    x        [M, K]          activations, unit stride along K, input columns in group order
    qweight  [Kp/8, N] int32 block-interleaved nibbles, Kp = 128 * ceil(K / 128)
    scales   [G, N]          activation dtype; zeros [G, N] same (absent: every z' is 8)
    out      [M, N]          activation dtype; ws [SPLIT_K, M, N] fp32; locks [>= tiles] int32

Launch configurations come from `triton_kernels.gptq_configs` (an explicit table by M).
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_kernels.gptq_common import accumulate_blocks, store_output


@triton.jit
def gptq_gemv_kernel(
    # pointers
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    locks_ptr,
    # sizes
    M,
    N,
    K,
    GROUP,
    NUM_GROUPS,
    BLOCKS_PER_SPLIT,
    SPLIT_K,
    # strides
    stride_xm,
    stride_qk,
    stride_sg,
    stride_om,
    # constexprs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SPLIT_K: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr = False,  # weights as tl.dot's first operand (gptq_common)
):
    # --- which output columns and which slice of K this program owns
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    block_start = pid_k * BLOCKS_PER_SPLIT
    block_end = tl.minimum(block_start + BLOCKS_PER_SPLIT, tl.cdiv(K, 128))

    # --- stream the weights of the slab once, fp32 accumulation
    acc = accumulate_blocks(
        x_ptr, qweight_ptr, scales_ptr, zeros_ptr, offs_m, offs_n, M, N, K, GROUP, NUM_GROUPS,
        block_start, block_end, stride_xm, stride_qk, stride_sg,
        BLOCK_M, BLOCK_N, SCALE_MODE, HAS_ZEROS, SWAP_AB,
    )  # fmt: skip

    # --- write, or reduce split-K partials in the last program to arrive
    store_output(
        acc, offs_m, offs_n, M, N, pid_k, pid_n, out_ptr, stride_om, bias_ptr, ws_ptr, locks_ptr,
        SPLIT_K, USE_SPLIT_K, HAS_BIAS,
    )  # fmt: skip
