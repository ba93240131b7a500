"""The 4-bit grid of one group, round-to-nearest, and packing results into the GPTQ format.

A group's grid is `scale * (q - zero)` for integers `q` in `[0, maxq]`. Scales are rounded to
fp16 *before* anything is rounded to the grid, so the dequantized weights the quantizer
returns (and feeds to later layers) are exactly what the written checkpoint dequantizes to.

Symmetric grids put the zero at `(maxq + 1) / 2` (8 for 4 bits; the grid spans
`[-8, 7] * scale` with `scale = 2 * max|w| / maxq`, AutoGPTQ's choice). Asymmetric grids span
`[min(w, 0), max(w, 0)]`. A v1 ("gptq") checkpoint stores `zero - 1` in a nibble and cannot hold
a zero of 0, so in that format an asymmetric zero is kept >= 1 (the scale widens to fit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedq.gptq.config import GPTQTensors
from pagedq.gptq.format import pack_cols, pack_rows

FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): floor for a rounded scale


@dataclass(frozen=True, slots=True)
class GridSpec:
    """How groups are gridded: bit width, symmetry and the smallest zero the format can store."""

    bits: int  # 4
    sym: bool  # zero fixed at the middle of the range
    min_zero: int  # 1 for asymmetric v1 checkpoints (zero stored minus one), else 0

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1


def find_grid(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of each row of `w` [N, g] (fp32): `(scale [N] fp16-exact, zero [N])`."""
    maxq = spec.maxq
    lo = w.min(dim=1).values.clamp(max=0.0)
    hi = w.max(dim=1).values.clamp(min=0.0)
    if spec.sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    flat = (lo == 0) & (hi == 0)
    lo = torch.where(flat, -1.0, lo)
    hi = torch.where(flat, 1.0, hi)
    scale = (hi - lo) / maxq
    if spec.sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale)
        short = zero < spec.min_zero  # v1 cannot store it: widen the positive side instead
        zero = torch.where(short, float(spec.min_zero), zero)
        scale = torch.where(short, hi / (maxq - spec.min_zero), scale)
    return _fp16_exact(scale), zero


def quantize_to_grid(
    w: torch.Tensor,  # [N] or [N, g] fp32
    scale: torch.Tensor,  # [N] (or broadcastable to w)
    zero: torch.Tensor,  # [N]
    maxq: int,
) -> torch.Tensor:
    """Integer grid points `q` (as fp32) nearest to `w`, clamped to `[0, maxq]`."""
    if w.dim() == 2 and scale.dim() == 1:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def rtn_columns(
    w: torch.Tensor,  # [N, K] fp32
    group_size: int | None,
    spec: GridSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round every group of columns to its own grid: `(q [N, K], scales [G, N], zeros [G, N])`."""
    k = w.shape[1]
    gs = k if group_size is None else group_size
    qs, scales, zeros = [], [], []
    for start in range(0, k, gs):
        block = w[:, start : start + gs]
        scale, zero = find_grid(block, spec)
        qs.append(quantize_to_grid(block, scale, zero, spec.maxq))
        scales.append(scale)
        zeros.append(zero)
    return torch.cat(qs, dim=1), torch.stack(scales), torch.stack(zeros)


def group_index(k: int, group_size: int | None, perm: torch.Tensor | None) -> torch.Tensor:
    """g_idx [K] int32 in original row order.

    Column `k` belongs to the group of the position where it was quantized: `pos // group_size`
    with `pos = k` without act-order, `pos = perm^-1[k]` with it (AutoGPTQ's layout).
    """
    if group_size is None:
        return torch.zeros(k, dtype=torch.int32)
    pos = torch.arange(k) if perm is None else torch.argsort(perm)
    return (pos // group_size).to(torch.int32)


def dequantize_grid(
    q: torch.Tensor,  # [N, K] grid integers (fp32 or int)
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K]
) -> torch.Tensor:
    """W [N, K] fp32: `scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])`."""
    g = g_idx.long()
    return scales.float()[g].t() * (q.float() - zeros.float()[g].t())


def pack_gptq(
    q: torch.Tensor,  # [N, K] grid integers in original column order
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] real zeros
    g_idx: torch.Tensor,  # [K] int32
    zero_offset: int,  # 1 for v1 ("gptq"), 0 for v2
    bias: torch.Tensor | None = None,  # [N]
) -> GPTQTensors:
    """The on-disk tensors: qweight [K/8, N], qzeros [G, N/8] (zero - offset), fp16 scales."""
    stored = zeros.to(torch.int64) - zero_offset
    assert int(stored.min()) >= 0, "grid zeros must be storable in the chosen format"
    return GPTQTensors(
        qweight=pack_rows(q.to(torch.int64).t().contiguous()),
        qzeros=pack_cols(stored),
        scales=scales.to(torch.float16),
        g_idx=g_idx.to(torch.int32),
        bias=None if bias is None else bias.to(torch.float16),
    )


def _fp16_exact(scale: torch.Tensor) -> torch.Tensor:
    """Round to fp16 and back; a scale that underflows becomes the smallest fp16 value."""
    rounded = scale.to(torch.float16).to(torch.float32)
    return torch.where(rounded > 0, rounded, FP16_TINY)


def split_gptq(t: GPTQTensors, out_sizes: list[int]) -> list[GPTQTensors]:
    """Split a fused weight's tensors along N (rows of W) into parts of `out_sizes`.

    Exact: GPTQ rows are independent given H, so the parts equal separate quantization. Every
    size must be a multiple of 8 (one qzeros word holds 8 output columns).
    """
    assert sum(out_sizes) == t.out_features and all(n % 8 == 0 for n in out_sizes)
    parts, start = [], 0
    for n in out_sizes:
        stop = start + n
        parts.append(
            GPTQTensors(
                qweight=t.qweight[:, start:stop].contiguous(),
                qzeros=t.qzeros[:, start // 8 : stop // 8].contiguous(),
                scales=t.scales[:, start:stop].contiguous(),
                g_idx=None if t.g_idx is None else t.g_idx.clone(),
                bias=None if t.bias is None else t.bias[start:stop].contiguous(),
            )
        )
        start = stop
    return parts
