"""GPTQLinear: a linear layer whose weight is stored 4-bit, repacked once at load for the kernels.

Load, per checkpoint linear ("part"), then per run of fusable parts:

1. Validate the tensors against each other and the config; errors name the part index, the
   tensor, its shape and the expected one (`CheckpointError`, `UnsupportedModelError`).
2. Unpack q [K, N] and the zero points z' [G, N] in int32, as the tool that wrote them reads
   them (`pagedq.gptq.format.unpack_zeros`): v1 ("gptq") adds 1 to the stored nibble (15 reads
   as 16), or, from GPTQModel >= 0.9, 0x11111111 to the whole word; v2 stores z' as is. A
   symmetric v1 checkpoint whose nibbles are all 8 actually stores v2 zeros and is read as v2.
3. Act-order: perm = stable argsort(g_idx) puts each group's rows together, so kernels see
   contiguous groups and multiply x[:, perm]. The sorted rows are cut into runs of
   `group_size` rows (the gcd of the group starts: the checkpoint's group size for every real
   checkpoint), and the scale/zero tables are re-indexed per run. group_size -1: one group.
4. Parts with equal g_idx (q/k/v, gate/up) are fused along N into one `PackedGPTQWeight`;
   parts whose g_idx differ keep their own and their outputs are concatenated.

The packed layout (block-interleaved nibbles, scales and zeros in the activation dtype, zeros
dropped when every z' is 8) is documented in `pagedq.ops.gptq.PackedGPTQWeight`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.errors import CheckpointError, ConfigError, UnsupportedModelError
from pagedq.gptq.config import GPTQConfig, GPTQTensors
from pagedq.gptq.format import unpack_cols, unpack_rows, unpack_zeros
from pagedq.ops.gptq import (
    PackedGPTQWeight,
    dequantize_packed,
    gptq_matmul,
    make_packed_weight,
    select_path,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, eq=False)
class _Normalized:
    """One checkpoint linear after validation, rows in group order, zeros as z'."""

    q: torch.Tensor  # [K, N] int32 0..15, rows sorted by group
    scales: torch.Tensor  # [G', N] fp32: one row per run of `group_size` sorted rows
    zeros: torch.Tensor  # [G', N] int32 z'
    group_size: int  # sorted rows per run
    perm: torch.Tensor | None  # [K] int64, None: identity
    g_idx: torch.Tensor  # [K] int64 as stored (fusion key)
    bias: torch.Tensor | None  # [N] float


class GPTQLinear(torch.nn.Module):
    """y = x @ W^T (+ bias) with W stored 4-bit. Built from one or more checkpoint linears that
    share the input (q/k/v or gate/up) and fused along N at load.

    Invariants: `out_features` is the sum of the parts' N, outputs come in part order; each
    segment (a run of parts with equal g_idx) is one `PackedGPTQWeight` held in buffers named
    `<tensor>_<segment>`, so `.to(device)` moves it. On CPU the `torch` path caches the
    dequantized fp32 weight at first use (CPU inference is for tests and small models).
    """

    def __init__(
        self,
        parts: Sequence[GPTQTensors],
        config: GPTQConfig | Sequence[GPTQConfig],  # one for all parts, or one per part
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        configs = [config] * len(parts) if isinstance(config, GPTQConfig) else list(config)
        if len(configs) != len(parts):
            raise ConfigError(f"GPTQLinear got {len(configs)} configs for {len(parts)} parts")
        for c in configs:
            _check_config(c)
        if dtype not in _DTYPES:
            raise ConfigError(f"GPTQLinear dtype {dtype} is not supported; use one of {_DTYPES}")
        if len(parts) == 0:
            raise CheckpointError("GPTQLinear needs at least one checkpoint linear, got 0")
        normalized = [
            _normalize_part(i, p, c, device)
            for i, (p, c) in enumerate(zip(parts, configs, strict=True))
        ]
        _check_same_k(normalized)
        self.in_features = int(normalized[0].q.shape[0])
        self.out_features = sum(int(p.q.shape[1]) for p in normalized)
        self.dtype = dtype
        self._sizes: list[tuple[int, int, int]] = []  # (K, N, group_size) per segment
        for s, run in enumerate(_fusion_runs(normalized)):
            self._add_segment(s, [normalized[i] for i in run], dtype, device)
        self._dense_t: torch.Tensor | None = None  # CPU cache: W^T [K, N] fp32
        self._dense_bias: torch.Tensor | None = None  # CPU cache: bias [N] fp32

    @property
    def num_segments(self) -> int:
        return len(self._sizes)

    def segment(self, s: int) -> tuple[PackedGPTQWeight, torch.Tensor | None]:
        """Packed weight and bias of segment `s` (views of this module's buffers)."""
        k, n, group_size = self._sizes[s]
        packed = PackedGPTQWeight(
            qweight=getattr(self, f"qweight_{s}"),
            scales=getattr(self, f"scales_{s}"),
            zeros=getattr(self, f"zeros_{s}"),
            perm=getattr(self, f"perm_{s}"),
            locks=getattr(self, f"locks_{s}"),
            in_features=k,
            out_features=n,
            group_size=group_size,
        )
        return packed, getattr(self, f"bias_{s}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] in `dtype` -> [..., N] in `dtype`."""
        if x.shape[-1] != self.in_features or x.dtype != self.dtype:
            raise ValueError(
                f"GPTQLinear takes [..., {self.in_features}] {self.dtype}, "
                f"got {tuple(x.shape)} {x.dtype}"
            )
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if not x2.is_cuda and select_path(x2, self.segment(0)[0]) == "torch":
            out = self._cpu_forward(x2)
        else:
            outs = [gptq_matmul(x2, *self.segment(s)) for s in range(self.num_segments)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """W [N, K] fp32 in checkpoint order (for tests and the reference path)."""
        columns = []
        for s in range(self.num_segments):
            packed, _ = self.segment(s)
            w_t = dequantize_packed(packed)  # [K, N_s], rows in group order
            if packed.perm is not None:
                w_t = torch.empty_like(w_t).index_copy_(0, packed.perm, w_t)
            columns.append(w_t)
        return torch.cat(columns, dim=1).t().contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={self.dtype}, segments={self.num_segments}"
        )

    def _add_segment(
        self, s: int, run: list[_Normalized], dtype: torch.dtype, device: torch.device | str
    ) -> None:
        packed = make_packed_weight(
            q=torch.cat([p.q for p in run], dim=1),
            scales=torch.cat([p.scales for p in run], dim=1),
            zeros=torch.cat([p.zeros for p in run], dim=1),
            group_size=run[0].group_size,
            perm=run[0].perm,
            dtype=dtype,
            device=device,
        )
        bias = None
        if any(p.bias is not None for p in run):
            pieces = [p.bias if p.bias is not None else p.q.new_zeros(p.q.shape[1]) for p in run]
            bias = torch.cat([b.to(device=device, dtype=dtype) for b in pieces])
        for name in ("qweight", "scales", "zeros", "perm", "locks"):
            self.register_buffer(f"{name}_{s}", getattr(packed, name), persistent=False)
        self.register_buffer(f"bias_{s}", bias, persistent=False)
        self._sizes.append((packed.in_features, packed.out_features, packed.group_size))

    def _cpu_forward(self, x2: torch.Tensor) -> torch.Tensor:
        """Reference path on CPU with the dequantized weight cached: x2 [M, K] -> [M, N]."""
        if self._dense_t is None or self._dense_t.device != x2.device:
            self._dense_t = self.dequantized_weight().t().contiguous()
            biases = [self.segment(s) for s in range(self.num_segments)]
            if any(b is not None for _, b in biases):
                pieces = [
                    b if b is not None else p.scales.new_zeros(p.out_features) for p, b in biases
                ]
                self._dense_bias = torch.cat(pieces).float()
        out = x2.float() @ self._dense_t  # [M, N] fp32 accumulate
        if self._dense_bias is not None:
            out += self._dense_bias
        return out.to(x2.dtype)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> GPTQLinear:
        self._dense_t = None  # buffers move or change dtype: drop the CPU cache
        self._dense_bias = None
        return super()._apply(fn, *args, **kwargs)


def _check_config(config: GPTQConfig) -> None:
    if config.bits != 4:
        raise UnsupportedModelError(f"GPTQ bits={config.bits} is not supported; pagedq runs 4 only")
    if config.pack_dtype != "int32":
        raise UnsupportedModelError(
            f"GPTQ pack_dtype={config.pack_dtype!r} is not supported; only 'int32' is"
        )
    if config.checkpoint_format not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(
            f"GPTQ checkpoint_format={config.checkpoint_format!r}; expected 'gptq' or 'gptq_v2'"
        )
    if config.group_size is not None and config.group_size != -1 and config.group_size <= 0:
        raise UnsupportedModelError(f"GPTQ group_size={config.group_size} must be positive or -1")


def _num_groups(config: GPTQConfig, k: int) -> int:
    gs = config.group_size
    return 1 if gs is None or gs == -1 else -(-k // gs)


def _check_part(i: int, t: GPTQTensors, config: GPTQConfig) -> tuple[int, int, int]:
    """Validate one part's tensors; returns (K, N, G)."""
    where = f"GPTQ part {i}"
    qw = t.qweight
    if qw.dtype != torch.int32 or qw.dim() != 2:
        raise CheckpointError(
            f"{where}: qweight must be 2-D int32, got {qw.dtype} {tuple(qw.shape)}"
        )
    k, n = int(qw.shape[0]) * 8, int(qw.shape[1])
    if k == 0 or n == 0 or n % 8 != 0:
        raise CheckpointError(
            f"{where}: qweight {tuple(qw.shape)} gives N={n}; N must be a positive multiple of 8"
        )
    g = _num_groups(config, k)
    _expect(where, "qzeros", t.qzeros, (g, n // 8), int_dtype=True)
    _expect(where, "scales", t.scales, (g, n), int_dtype=False)
    if t.g_idx is not None:
        gi = t.g_idx
        if gi.dim() != 1 or gi.numel() != k:
            raise CheckpointError(
                f"{where}: g_idx has shape {tuple(gi.shape)} but qweight {tuple(qw.shape)} gives "
                f"K={k} (K must be a multiple of 8 and match g_idx)"
            )
        if gi.is_floating_point() or gi.is_complex():
            raise CheckpointError(f"{where}: g_idx must be an integer tensor, got {gi.dtype}")
        lo, hi = int(gi.min()), int(gi.max())
        if lo < 0 or hi >= g:
            bad = lo if lo < 0 else hi
            raise CheckpointError(f"{where}: g_idx value {bad} is outside [0, {g}) groups")
    if t.bias is not None and tuple(t.bias.shape) != (n,):
        raise CheckpointError(f"{where}: bias has shape {tuple(t.bias.shape)}, expected ({n},)")
    return k, n, g


def _expect(
    where: str, name: str, t: torch.Tensor, shape: tuple[int, int], int_dtype: bool
) -> None:
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if int_dtype and t.dtype != torch.int32:
        raise CheckpointError(f"{where}: {name} must be int32, got {t.dtype}")
    if not int_dtype and not t.is_floating_point():
        raise CheckpointError(f"{where}: {name} must be floating point, got {t.dtype}")


def _normalize_part(
    i: int, t: GPTQTensors, config: GPTQConfig, device: torch.device | str
) -> _Normalized:
    k, _, g = _check_part(i, t, config)
    q = unpack_rows(t.qweight.to(device))  # [K, N]
    zq = t.qzeros.to(device)
    v2_in_v1 = config.sym and bool((unpack_cols(zq) == 8).all())  # labelled v1, stores v2 zeros
    offset = 0 if v2_in_v1 else config.zero_offset
    zeros = unpack_zeros(zq, offset, config.zeros_by_word and not v2_in_v1)  # [G, N]
    if t.g_idx is not None:
        g_idx = t.g_idx.to(device=device, dtype=torch.int64)
    elif g > 1:
        g_idx = torch.arange(k, device=device) // int(config.group_size or k)
    else:
        g_idx = torch.zeros(k, dtype=torch.int64, device=device)
    perm = torch.argsort(g_idx, stable=True)
    sorted_g = g_idx[perm]
    run = _run_length(sorted_g, k)
    first = sorted_g[::run]  # source group of each run of sorted rows
    identity = bool(torch.equal(perm, torch.arange(k, device=device)))
    return _Normalized(
        q=q if identity else q[perm],
        scales=t.scales.to(device=device, dtype=torch.float32)[first],
        zeros=zeros[first],
        group_size=run,
        perm=None if identity else perm,
        g_idx=g_idx,
        bias=None if t.bias is None else t.bias.to(device),
    )


def _run_length(sorted_g: torch.Tensor, k: int) -> int:
    """Largest L such that every group of the sorted rows starts at a multiple of L."""
    starts = (torch.nonzero(sorted_g[1:] != sorted_g[:-1]).flatten() + 1).tolist()
    return functools.reduce(math.gcd, starts, 0) or k


def _check_same_k(parts: list[_Normalized]) -> None:
    k0 = int(parts[0].q.shape[0])
    for i, p in enumerate(parts):
        if int(p.q.shape[0]) != k0:
            raise CheckpointError(
                f"GPTQ part {i} has K={int(p.q.shape[0])} inputs but part 0 has K={k0}; "
                "fused parts must share the input"
            )


def _fusion_runs(parts: list[_Normalized]) -> list[list[int]]:
    """Consecutive parts with equal g_idx share one packed weight."""
    runs: list[list[int]] = [[0]]
    for i in range(1, len(parts)):
        if torch.equal(parts[i].g_idx, parts[runs[-1][0]].g_idx):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
