"""Exp(1) noise for seeded sampling rows, as a pure function of (seed, step, column).

A seeded request's rows draw their sampling noise from their seed and the output position of
the token being sampled (`step`), so a token depends only on those and the logits: not on the
other rows of the batch, their order, launch-ahead or any RNG state. Per device:

- CUDA tensors: Philox4x32-10 (Salmon et al., 2011) with key = the seed and counter =
  (column, step, 0, 0), all seeded rows of a step in one launch
  (`triton_kernels/seeded_noise.py`; PAGEDQ_FUSED_BACKEND=torch runs
  `reference_seeded_exponential`, the same numbers computed with PyTorch ops).
- CPU tensors: a CPU `torch.Generator` per row seeded with a 64-bit mix of (seed, step). The
  Philox reference costs about 130 full-size integer passes, 4 s at 256 x 32,000 on a CPU.
  So the same seed draws different tokens on a CPU and on a GPU, as torch's generators do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedq.ops.fused import BACKEND_ENV  # the fused kernels' switch: triton or torch
from pagedq.ops.transfer import to_device
from pagedq.ops.triton_loader import env_backend, load_kernels

MAX_SEED = 2**63 - 1
MAX_STEP = 2**32 - 1
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Philox4x32 key increments
_MASK = 0xFFFFFFFF
_MASK64 = 2**64 - 1


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
    rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 (Salmon et al., 2011) on int64 tensors holding uint32 values (broadcast
    together); returns the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mul_hi_lo(c0, _M0)
        hi1, lo1 = _mul_hi_lo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of a * b for uint32 a (int64 tensor) and b, without int64
    overflow: b is split in 16-bit halves."""
    low = a * (b & 0xFFFF)  # < 2^48
    high = a * (b >> 16)  # < 2^48
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _MASK


def reference_seeded_exponential(
    seeds: torch.Tensor, steps: torch.Tensor, vocab: int
) -> torch.Tensor:
    """[rows, vocab] fp32 Exp(1) noise of rows (seeds[r], steps[r]), int64 [rows] each."""
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    zero = torch.zeros_like(cols)
    step = steps.to(torch.int64).unsqueeze(1) & _MASK
    key = (seeds.unsqueeze(1) & _MASK, (seeds.unsqueeze(1) >> 32) & _MASK)
    word, _, _, _ = philox4x32((cols, step + zero, zero, zero), key)
    u = (word >> 8).to(torch.float32) * (1.0 / 16777216.0)  # exact: 24 bits
    return -torch.log(1.0 - u)  # 1 - u is exact, as in the kernel


def seeded_exponential(
    seeds: Sequence[int], steps: Sequence[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(seeds), vocab] fp32 noise on `device`: row r from (seeds[r], steps[r])."""
    for name, values, limit in (("seed", seeds, MAX_SEED), ("step", steps, MAX_STEP)):
        if values and (min(values) < 0 or max(values) > limit):  # C loops: a per-step check
            bad = next(v for v in values if not 0 <= v <= limit)
            raise ValueError(f"{name} {bad} is outside [0, {limit}]")
    if device.type != "cuda":
        out = torch.empty((len(seeds), vocab), dtype=torch.float32)
        for row, seed, step in zip(out.unbind(0), seeds, steps, strict=True):
            row.exponential_(generator=torch.Generator().manual_seed(_mix(seed, step)))
        return out.to(device)
    seed_t, step_t = to_device([list(seeds), list(steps)], torch.int64, device)
    if env_backend(BACKEND_ENV, device) == "torch":
        return reference_seeded_exponential(seed_t, step_t, vocab)
    out = torch.empty((len(seeds), vocab), dtype=torch.float32, device=device)
    load_kernels("triton_kernels.seeded_noise", device).launch(seed_t, step_t, out)
    return out


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed for (seed, step): two splitmix64 steps."""
    return _splitmix64(_splitmix64(seed) ^ step) & MAX_SEED


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)
