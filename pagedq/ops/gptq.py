"""GPTQ 4-bit matmul: the packed weight layout, its reference, and the launcher that picks a kernel.

`PackedGPTQWeight` (built once at load by `pagedq.gptq.linear`) is the one layout every path
reads. `gptq_matmul_reference` dequantizes it and runs an fp32 matmul: the CPU path and the
test oracle. `gptq_matmul` dispatches by `PAGEDQ_GPTQ_BACKEND`, read on every call:

- `torch`: the reference (also what `auto` runs on CPU tensors);
- `auto` on CUDA tensors, by M = rows of x: the CUDA extension's GEMV for M <= SMALL_M_MAX_M
  (when it applies and built; tensor cores, persistent stream-K grid, see
  cuda_ext/gptq_gemv.cuh), else the Triton split-K GEMV; above SMALL_M_MAX_M on sm_90 the
  extension's wgmma GEMM (cuda_ext/gptq_gemm.cuh; tile height from `cuda_gemm_tile`), else
  the Triton GEMM;
- `cuda`: the CUDA kernels whenever they apply (fp16/bf16, group size a multiple of 32, K a
  multiple of 8; above SMALL_M_MAX_M only on sm_90), Triton otherwise or when the extension
  cannot be built (one notice);
- `triton`: the Triton kernels by M; on CPU tensors they run in the Triton interpreter
  (TRITON_INTERPRET=1 is set for the process if no GPTQ kernel module was imported yet, so
  Triton kernels imported later in the process are interpreted too).

Per call nothing synchronises the host (Python ints, `torch.empty`, launches), so every GPU
path can be captured in a CUDA graph; the CUDA extension builds on its first call, so run one
call before capturing. The CUDA kernels' launches on one device share one workspace
(`cuda_workspace`): run them on one stream at a time, as the engine does.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.errors import ConfigError

BACKEND_ENV = "PAGEDQ_GPTQ_BACKEND"
BACKENDS = ("auto", "cuda", "triton", "torch")

# Dispatch threshold on M (rows of x), set from bench/bench_gptq.py on an H200: small-M kernels
# up to here (the CUDA kernel where it applies, else the Triton split-K GEMV), tiled GEMM above.
# The CUDA kernel is the faster small-M path at every M, captured or eager (H200 bench stacks
# of 2026-11-30, gptq_w4a_2026-11-30l: 1.20 ms at M=1, 2.07 at M=16, Triton split-K GEMV
# 2.17..2.24; eager calls are host-bound and the CUDA op costs about a fifth of a Triton launch
# on the host).
SMALL_M_MAX_M = 16
# Above SMALL_M_MAX_M on sm_90, `auto` runs the wgmma GEMM for every layer: H200 per-layer µs of
# the Llama-2-7B stack, best tile against the Triton GEMM (gptq_w4a_2026-11-30p_notes.md):
# M=17..64: qkv 24 vs 24, o 14 vs 13, gate_up 34 vs 43-45, down 22 vs 24 (one o on Triton
# would cost more in switches between the kernels than it gains); M=128: 37 / 18 / 49 / 31 vs
# 54 / 21 / 78 / 43; M=256: 54 / 25 / 88 / 48 vs 77 / 28 / 126 / 60.
# Its tile height (64, 128 or 256 rows) comes from a cost model of one launch, fitted to those
# measurements at M = 64..256 (it picks the faster of 64 and 128 in all 16 cases): per tile
# height, µs per 128-row block of a CTA's share, fixed, times (k - 1) / k for an exact split in
# k parts, and per contributor of a stream-K tile (see `gemm_grid`). A 256-row tile is 128
# columns wide and costs 0.9x a 128-row tile's block: per-layer µs at M = 256..2048 were
# 0.89-1.0x (bench/results/gptq_w4a_2026-11-30s_notes.md).
_GEMM_COST = {
    64: (1.29, 4.09, 4.53, 1.72),
    128: (1.73, 7.99, 4.68, 3.77),
    256: (1.56, 7.99, 4.68, 3.77),
}
_GEMM_TILE_COLS = {64: 256, 128: 256, 256: 128}  # columns per tile by height (GemmTile::kCols)

BLOCK_K = 128  # input rows per packed block (the interleave period of `qweight`)
MIN_LOCKS = 1024  # arrival counters of split tiles per weight (>= tiles of any launch)
# Workspace values per SM. The CUDA GEMV's grid is at most one CTA per resident slot: 3 per SM
# on the H200 (registers), sized here for 4, each slot SMALL_M_MAX_M x 64 values. The GEMM's:
# one CTA per SM (shared memory), slots of 256 threads x 128 values.
_GEMV_VALUES_PER_SM = 4 * SMALL_M_MAX_M * 64
_GEMM_VALUES_PER_SM = 256 * 128
_INTERPRETER_SMS = 4  # "SM count" used to size split-K in the Triton interpreter
_KERNEL_MODULES = (
    "triton_kernels.gptq_common",
    "triton_kernels.gptq_gemv",
    "triton_kernels.gptq_gemm",
)


@dataclass(frozen=True, eq=False)
class PackedGPTQWeight:
    """One 4-bit weight W [N, K] repacked for pagedq's kernels (y = x @ W^T).

    Invariants (established by `make_packed_weight`, relied on by every kernel):
    - input rows are in group order: kernels multiply x[:, perm] (perm None: identity), and
      sorted row k belongs to group k // group_size (group_size = K: one group);
    - qweight is [Kp/8, N] int32 with Kp = 128 * ceil(K / 128): block b (word rows 16b..16b+15)
      holds sorted rows 128b..128b+127; nibble p + 4h (p = 0..3, h = 0..1, bits 4p + 16h ..)
      of word row 16b + r holds row 128b + 32p + 2r + h, so one shift-and-mask yields the
      (k, k+1) pair a tensor-core fragment keeps in one register; rows K..Kp-1 hold 0;
    - scales [G, N] with G = ceil(K / group_size), in the activation dtype; zeros [G, N] in the
      same dtype holds the zero point z' (v1's +1 already applied) as exact integers 0..16, or
      is None when every z' is 8; W^T[k, n] = (q[k, n] - z'[g, n]) * scales[g, n];
    - locks [>= max(ceil(N / 16), MIN_LOCKS)] int32 is all zeros between launches (the Triton
      split-K arrival counters; two launches on one weight must not run concurrently);
    - N % 8 == 0; every tensor is contiguous and on the same device.
    """

    qweight: torch.Tensor  # [Kp/8, N] int32, block-interleaved (see above)
    scales: torch.Tensor  # [G, N] activation dtype
    zeros: torch.Tensor | None  # [G, N] activation dtype (z'), None: every z' is 8
    perm: torch.Tensor | None  # [K] int64: column order of x the kernels expect
    locks: torch.Tensor  # [num_locks] int32 zeros
    in_features: int  # K
    out_features: int  # N
    group_size: int  # sorted rows per group (K when there is one group)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])


def _nibble_shifts(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[1, 4, 1, 2, 1]: bit offset 4p + 16h of row 32p + 2r + h within its word."""
    p = torch.arange(4, device=device, dtype=dtype).view(1, 4, 1, 1, 1)
    h = torch.arange(2, device=device, dtype=dtype).view(1, 1, 1, 2, 1)
    return 4 * p + 16 * h


def pack_blocks(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] of values 0..15 (rows in group order) -> qweight [Kp/8, N] int32, block layout."""
    k, n = q.shape
    kp = -(-k // BLOCK_K) * BLOCK_K
    padded = torch.zeros((kp, n), dtype=torch.int64, device=q.device)
    padded[:k] = q
    blocks = padded.view(kp // BLOCK_K, 4, 16, 2, n)  # [block, p, word row r, h, n]
    words = (blocks << _nibble_shifts(q.device, torch.int64)).sum(dim=(1, 3))  # [block, r, n]
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.reshape(kp // 8, n).to(torch.int32).contiguous()


def unpack_blocks(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `pack_blocks`: qweight [Kp/8, N] int32 -> q [K, N] int32 of values 0..15."""
    kw, n = qweight.shape
    words = qweight.view(kw // 16, 1, 16, 1, n)
    q = (words >> _nibble_shifts(qweight.device, torch.int32)) & 0xF  # [block, p, r, h, n]
    return q.reshape(kw * 8, n)[:k]


def make_packed_weight(
    q: torch.Tensor,  # [K, N] int values 0..15, rows in group order
    scales: torch.Tensor,  # [G, N] float
    zeros: torch.Tensor,  # [G, N] int: z' per group
    group_size: int,
    perm: torch.Tensor | None,  # [K] int64
    dtype: torch.dtype,
    device: torch.device | str,
) -> PackedGPTQWeight:
    """Repack normalised tensors into the kernel layout on `device` (see PackedGPTQWeight)."""
    k, n = q.shape
    assert n % 8 == 0 and scales.shape == zeros.shape == (-(-k // group_size), n)
    zeros_t = None if bool((zeros == 8).all()) else zeros.to(device=device, dtype=dtype)
    num_locks = max(-(-n // 16), MIN_LOCKS)
    if torch.device(device).type == "cuda":
        cuda_workspace(torch.device(device))  # made now, not inside a CUDA graph capture
    return PackedGPTQWeight(
        qweight=pack_blocks(q).to(device),
        scales=scales.to(device=device, dtype=dtype).contiguous(),
        zeros=None if zeros_t is None else zeros_t.contiguous(),
        perm=None if perm is None else perm.to(device=device, dtype=torch.int64),
        locks=torch.zeros(num_locks, dtype=torch.int32, device=device),
        in_features=k,
        out_features=n,
        group_size=group_size,
    )


def dequantize_packed(w: PackedGPTQWeight) -> torch.Tensor:
    """W^T [K, N] fp32 with rows in group order (row k of the result pairs with x[:, perm[k]])."""
    k = w.in_features
    q = unpack_blocks(w.qweight, k).float()  # [K, N]
    g = torch.arange(k, device=q.device) // w.group_size  # [K]
    z = w.zeros.float()[g] if w.zeros is not None else 8.0
    return (q - z) * w.scales.float()[g]


def gptq_backend() -> str:
    """The backend named by PAGEDQ_GPTQ_BACKEND (default `auto`), validated."""
    raw = os.environ.get(BACKEND_ENV, "auto")
    value = raw.strip().lower() or "auto"
    if value not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}={raw!r} is not a GPTQ backend; choose one of {BACKENDS}")
    return value


def select_path(x: torch.Tensor, w: PackedGPTQWeight) -> str:
    """The kernel `gptq_matmul` runs: 'torch', 'cuda' (the GEMV), 'cuda_gemm', 'triton_small'
    or 'triton_large'."""
    backend = gptq_backend()
    m = x.numel() // max(int(x.shape[-1]), 1)
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return "torch"
    if backend == "cuda" and not x.is_cuda:
        raise ValueError(f"{BACKEND_ENV}=cuda needs CUDA tensors, got x on {x.device}")
    if m <= SMALL_M_MAX_M:
        return "cuda" if backend != "triton" and _cuda_ext_applies(x, w) else "triton_small"
    if backend == "triton" or not _is_sm90(x.device):
        return "triton_large"
    return "cuda_gemm" if _cuda_ext_applies(x, w) else "triton_large"


def cuda_gemm_tile(m: int, n: int, k: int, device: torch.device) -> int:
    """Rows per tile (64, 128 or 256) of the wgmma GEMM for x [m, k] @ W^T [k, n] on `device`."""
    return gemm_tile_for(m, n, k, _num_sms(device))


@functools.lru_cache(maxsize=4096)  # on every call above 16 rows: once per shape
def gemm_tile_for(m: int, n: int, k: int, sms: int) -> int:
    """`cuda_gemm_tile` on a GPU with `sms` SMs (one CTA each): the tile the cost model
    `_GEMM_COST` says is faster; 64 up to 64 rows, where a taller tile would be half empty."""
    if m <= 64:
        return 64
    blocks = -(-k // BLOCK_K)

    def cost(tile: int) -> float:
        per_block, fixed, exact, stream = _GEMM_COST[tile]
        tiles = -(-n // _GEMM_TILE_COLS[tile]) * -(-m // tile)
        ctas, split = gemm_grid(tiles, blocks, sms)
        share = tiles * blocks / ctas  # blocks per CTA
        reduce = exact * (split - 1) / split if split else stream * blocks / share
        return per_block * share + fixed + reduce

    # 256-row tiles from 256 rows on: at M=192 they lost to the best of the others on every
    # layer (H200: qkv 56 vs 50 µs, o 26 vs 24, gate_up 80.5 vs 80.7, down 50 vs 46)
    return min((64, 128, 256) if m >= 256 else (64, 128), key=cost)


def gemm_grid(tiles: int, num_blocks: int, resident: int) -> tuple[int, int]:
    """The wgmma GEMM's grid (as gemm_grid in cuda_ext/gptq_gemm.cuh): (CTAs, k). Where the
    tiles fit, each is split into k = resident // tiles equal parts if that keeps 90% of the
    CTAs busy; else k = 0: stream-K over all resident CTAs."""
    k = min(resident // tiles, num_blocks)
    if k >= 1 and 10 * k * tiles >= 9 * resident:
        return k * tiles, k
    return min(resident, tiles * num_blocks), 0


def gptq_matmul_reference(
    x: torch.Tensor,  # [..., K] (M rows)
    w: PackedGPTQWeight,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Dequantize then matmul with fp32 accumulation: [..., K] -> [..., N] in x's dtype."""
    _check_inputs(x, w, bias)
    x2 = x.reshape(-1, w.in_features)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    out = x2.float() @ dequantize_packed(w)  # [M, N] fp32
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def gptq_matmul(
    x: torch.Tensor,  # [..., K] (M rows), same dtype as the weight's scales
    w: PackedGPTQWeight,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """y = x @ W^T (+ bias): [..., K] -> [..., N] in x's dtype, on the path `select_path` picks."""
    path = select_path(x, w)
    if path == "torch":
        return gptq_matmul_reference(x, w, bias)
    _check_inputs(x, w, bias)
    x2 = x.reshape(-1, w.in_features)  # [M, K]
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    elif x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        out = x2.new_empty((0, w.out_features))
    elif path in ("cuda", "cuda_gemm"):
        out = _launch_cuda(x2, w, bias, gemm=path == "cuda_gemm")
    else:
        out = _launch_triton(x2, w, bias, small=path == "triton_small")
    return out.reshape(*x.shape[:-1], w.out_features)


def _check_inputs(x: torch.Tensor, w: PackedGPTQWeight, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; the weight takes {w.in_features} inputs")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but the weight was packed for {w.dtype}")
    if x.device != w.qweight.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.qweight.device}")
    if bias is not None and (tuple(bias.shape) != (w.out_features,) or bias.device != x.device):
        raise ValueError(
            f"bias must be [{w.out_features}] on {x.device}, "
            f"got {tuple(bias.shape)} on {bias.device}"
        )


def _scale_mode(w: PackedGPTQWeight) -> int:
    """How often scales change in a 128-row block: 0 never, 1 per 32-row quarter, 2 per row."""
    if w.num_groups == 1 or w.group_size % BLOCK_K == 0:
        return 0
    return 1 if w.group_size % 32 == 0 else 2


def _launch_triton(
    x: torch.Tensor, w: PackedGPTQWeight, bias: torch.Tensor | None, small: bool
) -> torch.Tensor:
    """Run the Triton split-K GEMV (small) or tiled GEMM on x [M, K] -> [M, N]."""
    from triton_kernels import gptq_configs

    gemv_kernel, gemm_kernel = _triton_kernels(x.device)
    m, k = x.shape
    n = w.out_features
    cfg = gptq_configs.pick_config(small, m, n, k)
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    num_blocks = -(-k // BLOCK_K)
    split, per_split = gptq_configs.split_for(
        cfg, tiles, num_blocks, _num_sms(x.device), w.locks.numel()
    )
    if split * m * n >= 2**31:  # workspace offsets are int32 in the kernel
        split, per_split = 1, num_blocks
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    args: tuple[Any, ...] = (
        x, w.qweight, w.scales, w.scales if w.zeros is None else w.zeros,
        w.scales if bias is None else bias, out, ws, w.locks,
        m, n, k, w.group_size, w.num_groups, per_split, split,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
    )  # fmt: skip
    meta: dict[str, Any] = {
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "USE_SPLIT_K": split > 1,
        "SCALE_MODE": _scale_mode(w), "HAS_ZEROS": w.zeros is not None,
        "HAS_BIAS": bias is not None, "SWAP_AB": bool(cfg.swap_ab),
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
    }  # fmt: skip
    if small:
        gemv_kernel[(-(-n // cfg.block_n), split)](*args, **meta)
    else:
        gemm_kernel[(tiles, split)](*args, GROUP_M=cfg.group_m, **meta)
    return out


def _launch_cuda(
    x: torch.Tensor, w: PackedGPTQWeight, bias: torch.Tensor | None, gemm: bool
) -> torch.Tensor:
    """Run the CUDA extension's GEMV (pagedq::gptq_gemv, M <= 16) or wgmma GEMM
    (pagedq::gptq_gemm) on x [M, K] -> [M, N]."""
    if x.data_ptr() % 16 != 0 or x.stride(0) % 8 != 0:  # its 16-byte row copies need both
        x = x.clone(memory_format=torch.contiguous_format)
    if bias is not None:  # every input the op would reject is fixed or refused here
        bias = bias.to(x.dtype).contiguous()
    ws = cuda_workspace(x.device)
    if gemm:
        tile = cuda_gemm_tile(x.shape[0], w.out_features, w.in_features, x.device)
        return torch.ops.pagedq.gptq_gemm(
            x, w.qweight, w.scales, w.zeros, bias, ws, w.group_size, tile
        )
    return torch.ops.pagedq.gptq_gemv(x, w.qweight, w.scales, w.zeros, bias, ws, w.group_size)


def cuda_workspace(device: torch.device) -> torch.Tensor:
    """The CUDA kernels' workspace on `device`: the fp32 partial sums of split tiles, one slot per
    CTA, all -1 (empty) between launches. One per device, shared by the GEMV and the GEMM, so
    their launches run one at a time (see cuda_ext/gptq_gemv.cuh)."""
    return _cuda_workspace(_device_index(device))


@functools.cache
def _cuda_workspace(index: int) -> torch.Tensor:
    per_sm = _GEMV_VALUES_PER_SM
    if _is_sm90(torch.device("cuda", index)):  # the GEMM runs there too
        per_sm = max(per_sm, _GEMM_VALUES_PER_SM)
    size = _cuda_sms(index) * per_sm
    return torch.full((size,), -1, dtype=torch.int32, device=torch.device("cuda", index))


def _is_sm90(device: torch.device) -> bool:
    """Hopper (compute capability 9.0): the wgmma GEMM's target."""
    return device.type == "cuda" and _capability(_device_index(device)) == (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _cuda_ext_applies(x: torch.Tensor, w: PackedGPTQWeight) -> bool:
    """The CUDA kernels take this call (fp16/bf16, 32-row groups, K % 8 == 0) and the extension
    loads."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    if w.num_groups > 1 and w.group_size % 32 != 0:
        return False
    if w.in_features % 8 != 0:  # activations are copied 8 at a time
        return False
    from cuda_ext.build import gptq_ext_available

    return gptq_ext_available(x.device)


@functools.cache
def _cuda_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_sms(_device_index(device))


def _triton_kernels(device: torch.device) -> tuple[Any, Any]:
    """Import the kernel modules lazily; for CPU tensors, in the Triton interpreter."""
    if device.type != "cuda":
        _use_interpreter()
    from triton_kernels.gptq_gemm import gptq_gemm_kernel
    from triton_kernels.gptq_gemv import gptq_gemv_kernel

    if device.type != "cuda" and not _is_interpreted(gptq_gemv_kernel):
        raise ValueError(
            "the GPTQ Triton kernels were loaded for the GPU in this process; set "
            "TRITON_INTERPRET=1 before their first use to run them on CPU tensors"
        )
    return gptq_gemv_kernel, gptq_gemm_kernel


def _use_interpreter() -> None:
    """Turn the Triton interpreter on if no GPTQ kernel module has been imported yet."""
    if not any(name in sys.modules for name in _KERNEL_MODULES):
        os.environ["TRITON_INTERPRET"] = "1"


def _is_interpreted(kernel: Any) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
