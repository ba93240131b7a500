"""Sampling one token per row: temperature, top-k, top-p, min-p, then an exponential race.

The race: `argmax(probs / q)` with `q ~ Exp(1)` picks token i with probability `probs[i]`.
- `reference_sample`: PyTorch ops, given the noise; top-p sorts every row.
- `fused_sample`: the same on CUDA in one Triton launch that sorts nothing
  (`triton_kernels/sampling.py`): 256 rows of 32,000 cost a sort, a cumsum, a scatter, two
  softmaxes and a noise pass in PyTorch. Its noise is Philox at (seed, step), as
  `pagedq.ops.noise` draws it. PAGEDQ_FUSED_BACKEND=torch selects the PyTorch path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch
from numpy.typing import ArrayLike

from pagedq.ops.fused import BACKEND_ENV  # the fused kernels' switch: triton or torch
from pagedq.ops.noise import MAX_SEED, MAX_STEP
from pagedq.ops.transfer import to_device
from pagedq.ops.triton_loader import env_backend, load_kernels

FUSED_MAX_VOCAB = 131072  # triton_kernels.sampling.MAX_BLOCK: larger vocabularies use PyTorch


def column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Per-row scalars as a [rows, 1] float32 column on `device`."""
    return to_device(values, torch.float32, device).unsqueeze(1)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [rows, vocab] float32, temperature already applied
    top_k: Sequence[int | None],  # per row; None: off
    top_p: Sequence[float],  # per row, in (0, 1]; 1: off
) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    Top-k keeps the logits >= the k-th largest (ties with it are kept). Top-p then keeps the
    smallest prefix of the descending order (ties: lowest id first) whose probability mass,
    renormalised after top-k, reaches `top_p`; the most likely token is always kept.
    Returns a new tensor.
    """
    vocab = logits.shape[1]
    k = [vocab if v is None else min(v, vocab) for v in top_k]
    if all(p >= 1.0 for p in top_p):
        kth = torch.topk(logits, max(k), dim=-1).values  # [rows, max_k], descending
        return _mask_below_kth(logits, kth, k)
    ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [rows, vocab]
    if any(v < vocab for v in k):
        ordered = _mask_below_kth(ordered, ordered, k)
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
    p = column([v if v < 1.0 else math.inf for v in top_p], logits.device)
    ordered = ordered.masked_fill(mass_before >= p, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def _mask_below_kth(
    logits: torch.Tensor,  # [rows, vocab]
    descending: torch.Tensor,  # [rows, >= max(k)] each row's largest logits, descending
    k: Sequence[int],
) -> torch.Tensor:
    index = to_device(k, torch.int64, logits.device).unsqueeze(1) - 1
    kth = descending.gather(1, index)  # [rows, 1]
    return logits.masked_fill(logits < kth, -math.inf)


def apply_min_p(
    logits: torch.Tensor,  # [rows, vocab] float32
    min_p: Sequence[float],  # per row, in [0, 1]; 0: off
) -> torch.Tensor:
    """Set to -inf every logit whose probability is below `min_p` times the row's largest.

    `p_i >= min_p * p_max` is `logit_i >= logit_max + log(min_p)` whatever the
    normalisation, so no softmax is needed. Returns a new tensor.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + column(_log_min_p(min_p), logits.device)
    return logits.masked_fill(logits < threshold, -math.inf)


def _log_min_p(min_p: Sequence[float]) -> list[float]:
    return [math.log(v) if v > 0 else -math.inf for v in min_p]


def filtered_probs(
    logits: torch.Tensor,  # [rows, vocab] float32
    temperature: Sequence[float],  # per row, > 0
    top_k: Sequence[int | None],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """[rows, vocab] the distribution each row samples from: softmax of the logits over the
    temperature, after top-k, top-p and min-p (stages no row uses are skipped)."""
    x = logits
    if any(t != 1.0 for t in temperature):
        x = x / column(temperature, logits.device)
    if any(k is not None for k in top_k) or any(p < 1.0 for p in top_p):
        x = apply_top_k_top_p(x, top_k, top_p)
    if any(p > 0.0 for p in min_p):
        x = apply_min_p(x, min_p)
    return torch.softmax(x, dim=-1)


def reference_sample(
    logits: torch.Tensor,  # [rows, vocab] float32
    temperature: Sequence[float],
    top_k: Sequence[int | None],
    top_p: Sequence[float],
    min_p: Sequence[float],
    noise: torch.Tensor,  # [rows, vocab] Exp(1) draws
) -> torch.Tensor:
    """[rows] int64: each row's token by the exponential race over `filtered_probs`."""
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p)
    return torch.argmax(probs / floored(noise), dim=-1)


def floored(q: torch.Tensor) -> torch.Tensor:
    """q with its zeros raised to fp32's smallest normal, in place: Exp(1) may round to 0, and
    0 / q must stay finite for masked tokens (no NaN winners)."""
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def fused_available(logits: torch.Tensor) -> bool:
    """Whether `fused_sample` serves these logits (else the PyTorch path does)."""
    return env_backend(BACKEND_ENV, logits.device) == "triton" and (
        logits.shape[1] <= FUSED_MAX_VOCAB
    )


def fused_sample(
    logits: torch.Tensor,  # [rows, vocab] float32, last dim contiguous
    index: ArrayLike,  # [n] the rows to sample
    temperature: ArrayLike,  # [n] > 0
    top_k: ArrayLike,  # [n] >= 1; the vocab size or more: off
    top_p: ArrayLike,  # [n] in (0, 1]; 1: off
    min_p: ArrayLike,  # [n] in [0, 1]; 0: off
    seeds: ArrayLike,  # [n] in [0, MAX_SEED]
    steps: ArrayLike,  # [n] in [0, MAX_STEP]
    tokens: torch.Tensor,  # [rows] int64: tokens[index[j]] written
) -> None:
    """Sample rows `index` in one launch: as `reference_sample` with the noise
    `pagedq.ops.noise.seeded_exponential(seeds, steps)`, up to rounding in the masses.

    The per-row values are numpy arrays or sequences (numpy builds the two parameter blocks:
    a Python list of 256 rows costs about 100 µs to turn into a tensor)."""
    rows = np.asarray(index, dtype=np.int64)
    n = rows.shape[0]
    if n == 0:
        return
    vocab = logits.shape[1]
    ints = np.empty((4, n), dtype=np.int64)  # row, top_k, seed, step
    ints[0], ints[2], ints[3] = rows, seeds, steps
    ints[1] = np.minimum(top_k, vocab)
    low, high = ints[2:].min(axis=1), ints[2:].max(axis=1)
    if low.min() < 0 or high[0] > MAX_SEED or high[1] > MAX_STEP:
        raise ValueError(f"seeds must lie in [0, {MAX_SEED}] and steps in [0, {MAX_STEP}]")
    floats = np.empty((3, n), dtype=np.float32)  # temperature, top_p, log(min_p)
    floats[0], floats[1] = temperature, top_p
    with np.errstate(divide="ignore"):
        floats[2] = np.log(np.asarray(min_p, dtype=np.float64))  # log(0) = -inf: off
    device = logits.device
    _kernels(device).launch(
        logits,
        to_device(floats, torch.float32, device),
        to_device(ints, torch.int64, device),
        tokens,
        top_k=bool(ints[1].min() < vocab),
        top_p=bool(floats[1].min() < 1.0),
        min_p=bool(floats[2].max() > -math.inf),
    )


def token_logprobs(
    logits: torch.Tensor,  # [rows, vocab] float32
    tokens: torch.Tensor,  # [rows] int64
    values: torch.Tensor,  # [>= 2, rows] float64, contiguous: rows 0 and 1 written
) -> torch.Tensor:
    """Write the tokens (as float64) and their log-probs under softmax(logits) into values[0]
    and values[1]; return each row's logsumexp [rows] float32. On CUDA one pass per row
    (`triton_kernels/sampling.py`; torch.logsumexp takes five), else PyTorch ops."""
    if env_backend(BACKEND_ENV, logits.device) == "torch":
        lse = torch.logsumexp(logits, dim=-1)
        values[0] = tokens
        values[1] = logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        return lse
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _kernels(logits.device).launch_token_logprobs(logits, tokens, values, lse)
    return lse


def _kernels(device: torch.device) -> ModuleType:
    return load_kernels("triton_kernels.sampling", device, ("triton_kernels.seeded_noise",))
