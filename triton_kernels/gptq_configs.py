"""Launch configurations of the GPTQ 4-bit kernels, chosen by shape (plain Python, no Triton).

An explicit table instead of autotuning: the choice is deterministic, costs nothing per call and
never benchmarks inside a CUDA-graph capture. `pick_config(small, m, n, k)` is the one place a
launch is chosen: first the per-layer-shape table `TUNED` (keyed by kind, N and K, with M
buckets), then the generic tables by M. Retune with `bench/bench_gptq.py --sweep`: it times every
config per Llama-2-7B layer shape at M = 1, 16, 64, 256 and prints the `TUNED` table to paste.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_K = 128  # input rows per packed block (the layout's interleave period)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """One Triton launch configuration."""

    block_m: int  # rows of x per program (>= 16: tl.dot's minimum)
    block_n: int  # output columns per program
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles sharing a column slab (GEMM tile order)
    split_k: int = 0  # K splits; 0: chosen by `split_k` to fill SPLIT_K_WAVES waves
    swap_ab: int = 0  # 1: the dequantized weights are tl.dot's first operand (out^T = W x^T)


# (largest M, config) in increasing M; the last entry has no bound.
SMALL_M_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    # the H200 sweep's M=16 winner family on every Llama-2-7B shape (split-K chosen per shape)
    (16, KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, swap_ab=1)),
)
LARGE_M_CONFIGS: tuple[tuple[int | None, KernelConfig], ...] = (
    (32, KernelConfig(block_m=32, block_n=128, num_warps=4, num_stages=4)),
    # above 32 rows: the H200 sweep's family on every Llama-2-7B shape: 64-column tiles of 4
    # warps, the weights as tl.dot's first operand and kept in its register layout
    (64, KernelConfig(64, 64, num_warps=4, num_stages=3, swap_ab=1)),
    (None, KernelConfig(128, 64, num_warps=4, num_stages=3, swap_ab=1)),
)

# Per layer shape: (kind, N, K) -> ((largest M, config), ...) in increasing M, kind "small"
# (split-K GEMV, M <= 16) or "large" (GEMM). Shapes or M past the last bucket use the tables
# above. Filled from `bench/bench_gptq.py --sweep` on an H200 (Llama-2-7B fused projections).
ConfigTable = tuple[tuple[int, KernelConfig], ...]
# Swept on an NVIDIA H200 (2026-11-30, torch 2.11, triton 3.6) with the candidate families of
# triton_kernels/gptq_tuning.py (bench/results/gptq_w4a_sweep_2026-11-30d.log): 64-column tiles
# of 4 warps won every (shape, M) bucket. Dequantizing one nibble per element (the other
# variant swept then, since removed) won none.
# Entries are KernelConfig(block_m, block_n, num_warps, num_stages, group_m, split_k[, swap_ab]).
TUNED: dict[tuple[str, int, int], ConfigTable] = {
    ("small", 12288, 4096): (
        (1, KernelConfig(16, 64, 4, 4, 8, 4, swap_ab=1)),
        (16, KernelConfig(16, 64, 4, 3, 8, 4, swap_ab=1)),
    ),
    ("large", 12288, 4096): (
        (64, KernelConfig(64, 64, 4, 3, 8, 2, swap_ab=1)),
        (1 << 30, KernelConfig(128, 64, 4, 3, 8, 0, swap_ab=1)),
    ),
    ("small", 4096, 4096): (
        (1, KernelConfig(16, 64, 4, 4, 8, 8, swap_ab=1)),
        (16, KernelConfig(16, 64, 4, 3, 8, 8, swap_ab=1)),
    ),
    ("large", 4096, 4096): (
        (64, KernelConfig(64, 64, 4, 4, 8, 4, swap_ab=1)),
        (1 << 30, KernelConfig(128, 64, 4, 3, 8, 2, swap_ab=1)),
    ),
    ("small", 22016, 4096): (
        (1, KernelConfig(16, 64, 4, 4, 8, 4, swap_ab=1)),
        (16, KernelConfig(16, 64, 4, 3, 8, 4, swap_ab=1)),
    ),
    ("large", 22016, 4096): (
        (64, KernelConfig(64, 64, 4, 3, 8, 2, swap_ab=1)),
        (1 << 30, KernelConfig(128, 64, 4, 3, 8, 0, swap_ab=1)),
    ),
    ("small", 4096, 11008): (
        (1, KernelConfig(16, 64, 4, 4, 8, 8, swap_ab=1)),
        (16, KernelConfig(16, 64, 4, 3, 8, 8, swap_ab=1)),
    ),
    ("large", 4096, 11008): (
        (64, KernelConfig(64, 64, 4, 3, 8, 4, swap_ab=1)),
        (1 << 30, KernelConfig(128, 64, 4, 3, 8, 2, swap_ab=1)),
    ),
}

SPLIT_K_WAVES = 4  # Triton: split K until the grid has about this many programs per SM
MAX_SPLIT_K = 16  # upper bound on split-K (partials cost workspace traffic)


def small_m_config(m: int) -> KernelConfig:
    """Config of the split-K GEMV kernel for `m` rows (m <= 16)."""
    for max_m, cfg in SMALL_M_CONFIGS:
        if m <= max_m:
            return cfg
    raise ValueError(
        f"the small-M GPTQ kernel takes at most {SMALL_M_CONFIGS[-1][0]} rows, got {m}"
    )


def large_m_config(m: int) -> KernelConfig:
    """Config of the tiled GEMM kernel for `m` rows."""
    for max_m, cfg in LARGE_M_CONFIGS:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("LARGE_M_CONFIGS must end with an unbounded entry")


def pick_config(small: bool, m: int, n: int, k: int) -> KernelConfig:
    """The launch config for x [m, k] @ W^T [k, n]: the per-shape table, else the table by M."""
    for max_m, cfg in TUNED.get(("small" if small else "large", n, k), ()):
        if m <= max_m:
            return cfg
    return small_m_config(m) if small else large_m_config(m)


def split_for(
    cfg: KernelConfig, tiles: int, num_blocks: int, num_sms: int, max_tiles: int
) -> tuple[int, int]:
    """(split, blocks_per_split): the config's fixed split (no empty split) or `split_k`'s."""
    if cfg.split_k <= 0:
        return split_k(tiles, num_blocks, num_sms, max_tiles)
    if tiles > max_tiles or num_blocks <= 1:
        return 1, num_blocks
    per_split = -(-num_blocks // min(cfg.split_k, num_blocks))
    return -(-num_blocks // per_split), per_split


def split_k(
    tiles: int,
    num_blocks: int,
    num_sms: int,
    max_tiles: int,
    min_blocks: int = 1,
    waves: int | None = None,
) -> tuple[int, int]:
    """(split, blocks_per_split) so that `tiles * split` fills about `waves` (default
    SPLIT_K_WAVES) programs per SM.

    Every split gets at least `min_blocks` 128-row blocks (when there are that many) and no split
    is empty. Split-K needs one lock per tile: with more than `max_tiles` tiles it is off.
    """
    if tiles > max_tiles or num_blocks <= 1:
        return 1, num_blocks
    wanted = -(-(SPLIT_K_WAVES if waves is None else waves) * num_sms // tiles)
    split = max(1, min(wanted, MAX_SPLIT_K, num_blocks // max(min_blocks, 1)))
    per_split = -(-num_blocks // split)
    return -(-num_blocks // per_split), per_split
