"""GPTQ 4-bit matmul for large batches (M > 16): tiled GEMM dequantizing in-kernel into tl.dot.

Algorithm: program (pid, pid_k) computes one [BLOCK_M, BLOCK_N] output tile over the 128-row
input blocks [pid_k * BLOCKS_PER_SPLIT, +BLOCKS_PER_SPLIT). Tiles are visited in groups of
GROUP_M row tiles per column tile, so a column slab of packed weights is reused from L2 by the
row tiles that need it. Each step loads a [16, BLOCK_N] tile of packed words (16-byte loads
along N), dequantizes it to [128, BLOCK_N] in the activation dtype (`gptq_common.dequant_block`)
and feeds tl.dot with the contiguous [BLOCK_M, 128] activation tile; accumulation is fp32.
Split-K (SPLIT_K > 1) is used only when there are too few tiles to fill the GPU; the last
program of a tile reduces the partials (`gptq_common.store_output`).

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
def gptq_gemm_kernel(
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
    GROUP_M: tl.constexpr,
    USE_SPLIT_K: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr = False,  # weights as tl.dot's first operand (gptq_common)
):
    # --- grouped tile order: GROUP_M row tiles share each column slab
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    block_start = pid_k * BLOCKS_PER_SPLIT
    block_end = tl.minimum(block_start + BLOCKS_PER_SPLIT, tl.cdiv(K, 128))

    # --- main loop: dequantize a [128, BLOCK_N] weight tile per step into tl.dot
    acc = accumulate_blocks(
        x_ptr, qweight_ptr, scales_ptr, zeros_ptr, offs_m, offs_n, M, N, K, GROUP, NUM_GROUPS,
        block_start, block_end, stride_xm, stride_qk, stride_sg,
        BLOCK_M, BLOCK_N, SCALE_MODE, HAS_ZEROS, SWAP_AB,
    )  # fmt: skip

    # --- write, or reduce split-K partials in the last program to arrive
    store_output(
        acc, offs_m, offs_n, M, N, pid_k, pid, out_ptr, stride_om, bias_ptr, ws_ptr, locks_ptr,
        SPLIT_K, USE_SPLIT_K, HAS_BIAS,
    )  # fmt: skip
