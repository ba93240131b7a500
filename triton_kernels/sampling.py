"""Sampling of one token per row in one launch: temperature, top-k, top-p, min-p, then the
exponential race, without sorting the vocabulary.

Algorithm (one program per sampled row, the whole row in registers):
- x = logits / temperature; m = max(x).
- top-k: the k-th largest x, found exactly by a 32-step bisection over the order-preserving
  integer keys of the fp32 values (count of keys >= candidate); x >= it is kept (ties too).
- top-p: p = softmax of the top-k survivors. A 31-step bisection over the bits of p finds
  tau, the smallest probability whose strictly larger ones weigh less than top_p: every token
  above tau is kept, and the tokens equal to tau in id order while the mass before them stays
  below top_p (the order a stable descending sort gives).
- min-p: x >= m + log(min_p) is kept.
- the winner: argmax over kept tokens of p / q, q ~ Exp(1) from Philox at (seed, step) as in
  `seeded_noise.py`; ties go to the lowest id.
`pagedq.ops.sampling.reference_sample` is the same computation with a sort, in PyTorch. The
masses are summed in another order there, so a token whose mass-before lies within rounding
of top_p can fall on either side.

Tensor layouts (n sampled rows):
  logits  [rows, vocab] fp32, row stride `stride`, last dim contiguous
  fparams [3, n] fp32: temperature, top_p (1: off), log(min_p) (-inf: off)
  iparams [4, n] int64: row (the logits row and token slot of program i), top_k (vocab:
          off), seed (0 <= seed < 2^63), step (< 2^32)
  tokens  [rows] int64: tokens[row] written
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels.seeded_noise import seeded_exponential

MAX_BLOCK = 131072  # the largest vocabulary sampled in registers (Llama 3: 128,256)
_TINY = tl.constexpr(1.1754943508222875e-38)  # fp32's smallest normal: the noise's floor


@triton.jit
def _ordered_key(x):
    """Order-preserving uint32 key of fp32 x: a < b exactly when key(a) < key(b)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | (-2147483647 - 1)  # negative: all bits; else the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _sample_kernel(
    # pointers
    logits_ptr,
    fparams_ptr,
    iparams_ptr,
    tokens_ptr,
    # sizes
    stride,
    n,
    VOCAB,
    # constexprs
    BLOCK: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(iparams_ptr + i)
    cols = tl.arange(0, BLOCK)
    inside = cols < VOCAB
    logits = tl.load(logits_ptr + row * stride + cols, mask=inside, other=-float("inf"))
    x = logits / tl.load(fparams_ptr + i)
    m = tl.max(x, axis=0)
    keep = inside
    if TOP_K:
        k = tl.load(iparams_ptr + n + i).to(tl.int32)
        if k < VOCAB:
            key = _ordered_key(x)
            # the largest t with count(key >= t) >= k is the k-th largest key: bisect, one
            # bit at a time from the top
            t = tl.full((), 0, tl.uint32)
            one = tl.full((), 1, tl.uint32)
            for bit in tl.static_range(31, -1, -1):
                cand = t | (one << bit)
                if tl.sum((key >= cand).to(tl.int32), axis=0) >= k:
                    t = cand
            keep = keep & (key >= t)
    e = tl.where(keep, tl.exp(x - m), 0.0)  # the top-k survivors' weights
    if TOP_P:
        top_p = tl.load(fparams_ptr + n + i)
        if top_p < 1.0:
            p = e / tl.sum(e, axis=0)
            bits = p.to(tl.int32, bitcast=True)  # p >= 0: the bits order as the values
            # the largest t with mass(bits > t) >= top_p; tau = t + 1 is then a value of p
            t = 0
            for bit in tl.static_range(30, -1, -1):
                cand = t + (1 << bit)
                if tl.sum(tl.where(bits > cand, p, 0.0), axis=0) >= top_p:
                    t = cand
            tau = t + 1
            tie = bits == tau
            keep_p = bits > tau
            if tl.sum(tie.to(tl.int32), axis=0) == 1:
                keep_p = keep_p | tie
            else:  # ties at tau are kept in id order while the mass before them < top_p
                above = tl.sum(tl.where(keep_p, p, 0.0), axis=0)
                rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
                tau_p = tau.to(tl.float32, bitcast=True)
                keep_p = keep_p | (tie & (above + rank.to(tl.float32) * tau_p < top_p))
            e = tl.where(keep_p, e, 0.0)
    if MIN_P:
        e = tl.where(x >= m + tl.load(fparams_ptr + 2 * n + i), e, 0.0)
    seed = tl.load(iparams_ptr + 2 * n + i)
    step = tl.load(iparams_ptr + 3 * n + i)
    q = tl.maximum(seeded_exponential(seed, step, cols), _TINY)
    score = tl.where(inside, (e / tl.sum(e, axis=0)) / q, -1.0)
    tl.store(tokens_ptr + row, tl.argmax(score, axis=0).to(tl.int64))


def launch(
    logits: torch.Tensor,
    fparams: torch.Tensor,
    iparams: torch.Tensor,
    tokens: torch.Tensor,
    top_k: bool,
    top_p: bool,
    min_p: bool,
) -> None:
    """tokens[row] = the sample of logits row `row` for each row of iparams[0] (layouts: module
    docstring); the flags compile the stages any row of the batch uses."""
    n = iparams.shape[1]
    vocab = logits.shape[1]
    if n == 0:
        return
    block = triton.next_power_of_2(vocab)
    if block > MAX_BLOCK:
        raise ValueError(f"vocab {vocab} is larger than the fused sampler's {MAX_BLOCK}")
    _sample_kernel[(n,)](
        logits, fparams, iparams, tokens, logits.stride(0), n, vocab,
        BLOCK=block, TOP_K=top_k, TOP_P=top_p, MIN_P=min_p,
        num_warps=16 if block >= 16384 else 4,
    )  # fmt: skip
