"""Sampling of one token per row in one launch: temperature, top-k, top-p, min-p, then the
exponential race, without sorting the vocabulary.

Algorithm (one program per sampled row). Phase 1 holds the row in registers and finds the
thresholds, as scalars:
- x = logits / temperature; m = max(x).
- top-k: the k-th largest x, found exactly by a 32-step bisection over the order-preserving
  integer keys of the fp32 values (count of keys >= candidate); x >= it is kept (ties too).
- top-p: p = softmax of the top-k survivors. A 30-step bisection over the bits of p finds
  tau, the smallest probability whose strictly larger ones weigh less than top_p: every token
  above tau is kept, and the tokens equal to tau in id order while the mass before them stays
  below top_p (the order a stable descending sort gives).
- min-p: x >= m + log(min_p) is kept.
Phase 2 reads the row again (from L2) in chunks, so that the noise's Philox state never meets
the whole row: the winner is the argmax over kept tokens of exp(x - m) / q, q ~ Exp(1) from
Philox at (seed, step) as in `seeded_noise.py` (the same argmax as probs / q); ties go to the
lowest id.
`pagedq.ops.sampling.reference_sample` is the same computation with a sort, in PyTorch. The
masses are summed in another order there, so a token whose mass-before lies within rounding
of top_p can fall on either side.

The second kernel, `_token_logprob_kernel`, reports each row's chosen token and its log-prob
under softmax(logits) (`launch_token_logprobs`), in the order of operations torch.logsumexp
uses, for every sampled or greedy step.

Tensor layouts of the sampling kernel (n sampled rows):
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
CHUNK = 4096  # columns per step of the second pass
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
    CHUNK: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
):
    # Phase 1, the whole row in registers: the thresholds, as scalars. Phase 2 streams the row
    # again in chunks (from L2), so the noise's Philox state never meets the whole row.
    i = tl.program_id(0)
    row = tl.load(iparams_ptr + i)
    src = logits_ptr + row * stride
    temperature = tl.load(fparams_ptr + i)
    cols = tl.arange(0, BLOCK)
    x = tl.load(src + cols, mask=cols < VOCAB, other=-float("inf")) / temperature
    m = tl.max(x, axis=0)
    t_k = tl.full((), 0, tl.uint32)  # top-k: keep key(x) >= t_k (0: everything)
    if TOP_K:
        k = tl.load(iparams_ptr + n + i).to(tl.int32)
        if k < VOCAB:
            key = _ordered_key(x)
            # the largest t with count(key >= t) >= k is the k-th largest key: bisect, one
            # bit at a time from the top
            one = tl.full((), 1, tl.uint32)
            for bit in tl.static_range(31, -1, -1):
                cand = t_k | (one << bit)
                if tl.sum((key >= cand).to(tl.int32), axis=0) >= k:
                    t_k = cand
        x = tl.where(_ordered_key(x) >= t_k, x, -float("inf"))
    w = tl.exp(x - m)  # the top-k survivors' weights
    total = tl.sum(w, axis=0)
    # top-p: keep bits(p) > tau, and the ties at tau while the mass before them < top_p
    tau = tl.full((), -1, tl.int32)
    above = tl.full((), 0.0, tl.float32)
    top_p = tl.full((), 1.0, tl.float32)
    if TOP_P:
        top_p = tl.load(fparams_ptr + n + i)
        if top_p < 1.0:
            p = w / total
            bits = p.to(tl.int32, bitcast=True)  # p >= 0: the bits order as the values
            # the largest t with mass(bits > t) >= top_p (p <= 1: t < 2^30); tau = t + 1 is
            # then a value of p
            t = tl.full((), 0, tl.int32)
            for bit in tl.static_range(29, -1, -1):
                cand = t + (1 << bit)
                if tl.sum(tl.where(bits > cand, p, 0.0), axis=0) >= top_p:
                    t = cand
            tau = t + 1
            above = tl.sum(tl.where(bits > tau, p, 0.0), axis=0)
    threshold = tl.full((), -float("inf"), tl.float32)  # min-p: keep x >= threshold
    if MIN_P:
        threshold = m + tl.load(fparams_ptr + 2 * n + i)

    # Phase 2: the race over the kept tokens, chunk by chunk; ties go to the lowest id.
    seed = tl.load(iparams_ptr + 2 * n + i)
    step = tl.load(iparams_ptr + 3 * n + i)
    tau_p = tau.to(tl.float32, bitcast=True)
    best = tl.full((), -1.0, tl.float32)
    best_col = tl.full((), 0, tl.int32)
    tied = tl.full((), 0, tl.int32)
    for start in range(0, VOCAB, CHUNK):
        c = start + tl.arange(0, CHUNK)
        inside = c < VOCAB
        xc = tl.load(src + c, mask=inside, other=-float("inf")) / temperature
        keep = inside
        if TOP_K:
            keep = keep & (_ordered_key(xc) >= t_k)
        wc = tl.exp(xc - m)
        if TOP_P:  # ties are ranked among the top-k survivors, before min-p
            bits_c = (wc / total).to(tl.int32, bitcast=True)
            tie = keep & (bits_c == tau)
            rank = tied + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            kept_tie = tie & (above + rank.to(tl.float32) * tau_p < top_p)
            keep = keep & ((bits_c > tau) | kept_tie)
            tied += tl.sum(tie.to(tl.int32), axis=0)
        keep = keep & (xc >= threshold)
        q = tl.maximum(seeded_exponential(seed, step, c), _TINY)
        score = tl.where(keep, wc / q, tl.where(inside, 0.0, -1.0))
        top = tl.max(score, axis=0)
        if top > best:
            best = top
            best_col = start + tl.argmax(score, axis=0)
    tl.store(tokens_ptr + row, best_col.to(tl.int64))


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
        BLOCK=block, CHUNK=CHUNK, TOP_K=top_k, TOP_P=top_p, MIN_P=min_p,
        num_warps=max(4, min(32, block // 1024)),
    )  # fmt: skip


@triton.jit
def _token_logprob_kernel(
    # pointers
    logits_ptr,
    tokens_ptr,
    values_ptr,
    lse_ptr,
    # sizes
    stride,
    rows,
    VOCAB,
    # constexprs
    CHUNK: tl.constexpr,
):
    # as torch.logsumexp: the max first, then the sum of exp(x - max), in fp32
    r = tl.program_id(0)
    src = logits_ptr + r.to(tl.int64) * stride
    m = tl.full((), -float("inf"), tl.float32)
    for start in range(0, VOCAB, CHUNK):
        c = start + tl.arange(0, CHUNK)
        m = tl.maximum(m, tl.max(tl.load(src + c, mask=c < VOCAB, other=-float("inf")), axis=0))
    total = tl.full((), 0.0, tl.float32)
    for start in range(0, VOCAB, CHUNK):
        c = start + tl.arange(0, CHUNK)
        x = tl.load(src + c, mask=c < VOCAB, other=-float("inf"))
        total += tl.sum(tl.exp(x - m), axis=0)
    lse = tl.log(total) + m
    token = tl.load(tokens_ptr + r)
    tl.store(lse_ptr + r, lse)
    tl.store(values_ptr + r, token.to(tl.float64))
    tl.store(values_ptr + rows + r, (tl.load(src + token) - lse).to(tl.float64))


def launch_token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor, lse: torch.Tensor
) -> None:
    """values[0] = tokens, values[1] = their log-probs under softmax(logits) (float64 [>= 2,
    rows], contiguous); lse [rows] fp32 = each row's logsumexp."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    _token_logprob_kernel[(rows,)](
        logits, tokens, values, lse, logits.stride(0), rows, vocab, CHUNK=CHUNK, num_warps=8
    )
