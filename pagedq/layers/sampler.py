"""The batched sampler: one row of logits per sequence in, one token per sequence out.

Stages, in order (as in vLLM); each is one pass over `[rows, vocab]` and is skipped when no
row of the batch uses it:

1. raw log-probs of the incoming logits (`logsumexp`, plus `topk` when a row asks for
   top log-probs): reported log-probs never see penalties or temperature;
2. `min_tokens`: stop ids masked to -inf while the output is shorter than `min_tokens`;
3. repetition penalty (HF: positive logits / p, others * p, over prompt + output tokens),
   then presence / frequency penalties (OpenAI: subtracted over output-token counts);
4. greedy rows: argmax (ties go to the lowest id);
5. sampled rows: temperature, top-k, top-p, min-p (each keeps at least one token), then an
   exponential race: `argmax(probs / q)` with `q ~ Exp(1)` picks token i with probability
   `probs[i]`. A seeded row's `q` is a pure function of its seed and output position
   (`pagedq.ops.noise`: Philox), so its tokens do not depend on the other rows of the batch,
   their order, or anything the device's RNG did before. On CUDA, batches with top-k or
   top-p run all of stage 5 as one launch without a sort (`pagedq.ops.sampling`).

Everything the host reads back (tokens, log-probs, top log-probs) comes in one transfer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedq.ops.noise import seeded_exponential
from pagedq.ops.sampling import (
    column,
    fused_available,
    fused_sample,
    reference_sample,
    token_logprobs,
)
from pagedq.ops.transfer import to_device
from pagedq.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs of one sequence in this step."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt then output so far (read, never copied, unless penalised)
    num_prompt_tokens: int
    seed: int | None  # the sequence's noise seed (seeded requests, 0 <= seed < 2**63); None:
    # the global torch RNG
    stop_token_ids: frozenset[int]  # masked while len(output) < params.min_tokens (eos ∪ stop)

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """The tokens chosen in one step, in row order, as Python values."""

    token_ids: list[int]  # one per row
    logprobs: list[float]  # log-prob of each sampled token under the raw model distribution
    top_logprobs: list[dict[int, float] | None]  # top-`params.logprobs` ids -> raw log-prob


def _scatter_index(
    seqs: Sequence[Collection[int]], owners: Sequence[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index pairs putting each id of `seqs[j]` in row `owners[j]`.

    Returns two [n] int64 tensors on `device`, built on the host with numpy (no per-id
    Python work). Ids outside [0, vocab) are dropped: they name no logit.
    """
    count = sum(len(s) for s in seqs)
    cols = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=count)
    rows = np.repeat(np.asarray(owners, dtype=np.int64), [len(s) for s in seqs])
    inside = (cols >= 0) & (cols < vocab)
    if not inside.all():
        rows, cols = rows[inside], cols[inside]
    return to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)


def _all_alike(params: Sequence[SamplingParams]) -> bool:
    """Whether every row has the params of the first (equal params decide alike). A batch that
    shares one object passes through `list.count`'s identity test in C; one whose last row
    holds another object goes row by row at once (`count` would call the dataclass `__eq__`
    for every equal copy: 250 µs for 256 requests' own params)."""
    first = params[0]
    return params[-1] is first and params.count(first) == len(params)


@dataclass(slots=True)
class _BatchPlan:
    """Which rows each stage touches (indices into the batch, ascending), from the rows'
    params: one pass per distinct SamplingParams object, not per row. A batch usually shares
    one (B=256 greedy on the CPU machine: 5.6 µs per step, 20 row by row)."""

    sampled: list[int]  # rows that are not greedy
    min_tokens: list[int]  # rows whose stop ids are masked this step
    repetition: list[int]  # rows with a repetition penalty
    additive: list[int]  # rows with a presence or frequency penalty
    num_top: list[int | None]  # per row: top log-probs wanted
    max_top: int  # the largest of num_top (0: none wanted)

    @classmethod
    def of(cls, rows: Sequence[SamplingRow]) -> _BatchPlan:
        params = [row.params for row in rows]
        first = params[0]
        if not _all_alike(params):  # row by row: one pass per stage
            hot = GREEDY_TEMPERATURE_EPS
            return cls(
                sampled=[i for i, p in enumerate(params) if p.temperature >= hot],
                min_tokens=[
                    i for i, p in enumerate(params) if p.min_tokens and _masks_stops(rows[i])
                ],
                repetition=[i for i, p in enumerate(params) if p.repetition_penalty != 1.0],
                additive=[
                    i for i, p in enumerate(params)
                    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                ],
                num_top=[p.logprobs for p in params],
                max_top=max(p.logprobs or 0 for p in params),
            )  # fmt: skip
        every = range(len(rows))
        return cls(
            sampled=list(every) if first.temperature >= GREEDY_TEMPERATURE_EPS else [],
            min_tokens=[i for i in every if _masks_stops(rows[i])] if first.min_tokens else [],
            repetition=list(every) if first.repetition_penalty != 1.0 else [],
            additive=list(every)
            if first.presence_penalty != 0.0 or first.frequency_penalty != 0.0
            else [],
            num_top=[first.logprobs] * len(rows),
            max_top=first.logprobs or 0,
        )


def _masks_stops(row: SamplingRow) -> bool:
    """Whether the row's stop ids are masked this step (`min_tokens` not reached yet)."""
    return bool(row.stop_token_ids) and row.num_output_tokens < row.params.min_tokens


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], targets: Sequence[int]
) -> None:
    """Mask (in place) the stop ids of rows `targets`: logits [rows, vocab]."""
    ids = [rows[i].stop_token_ids for i in targets]
    index = _scatter_index(ids, targets, logits.shape[1], logits.device)
    logits.index_put_(index, torch.full((), -math.inf, device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    repetition: Sequence[int],
    additive: Sequence[int],
) -> None:
    """Apply the repetition penalty of rows `repetition`, then presence / frequency of rows
    `additive`, in place. logits: [rows, vocab].

    Repetition (HF) divides positive logits and multiplies the others by
    `repetition_penalty` for every id seen in prompt + output. Presence and frequency
    (OpenAI) subtract `presence * (count > 0) + frequency * count` over output-token counts.
    """
    if repetition:
        _apply_repetition(logits, rows, repetition)
    if additive:
        _apply_presence_frequency(logits, rows, additive)


def _apply_repetition(
    logits: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]
) -> None:
    device = logits.device
    seqs = [s for i in idx for s in (rows[i].prompt_token_ids, rows[i].output_token_ids)]
    owners = [i for i in idx for _ in range(2)]
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)  # [rows, vocab]
    index = _scatter_index(seqs, owners, logits.shape[1], device)
    seen.index_put_(index, torch.ones((), dtype=torch.bool, device=device))
    penalty = torch.ones(logits.shape[0], 1, dtype=logits.dtype, device=device)  # [rows, 1]
    penalty[list(idx)] = column([rows[i].params.repetition_penalty for i in idx], device)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    torch.where(seen, penalised, logits, out=logits)


def _apply_presence_frequency(
    logits: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]
) -> None:
    device = logits.device
    outputs = [rows[i].output_token_ids for i in idx]
    if not any(outputs):
        return
    counts = torch.zeros(len(idx), logits.shape[1], dtype=logits.dtype, device=device)
    index = _scatter_index(outputs, range(len(idx)), logits.shape[1], device)
    ones = torch.ones(index[0].shape[0], dtype=logits.dtype, device=device)
    counts.index_put_(index, ones, accumulate=True)
    presence = column([rows[i].params.presence_penalty for i in idx], device)
    frequency = column([rows[i].params.frequency_penalty for i in idx], device)
    delta = counts * frequency + (counts > 0).to(logits.dtype) * presence  # [len(idx), vocab]
    logits.index_add_(0, to_device(list(idx), torch.int64, device), delta, alpha=-1.0)


def _exponential_noise(like: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """q ~ Exp(1) shaped like `like` [rows, vocab] (float32): a seeded row's from its seed and
    the position of the token it samples (its output length), the others' from the global
    RNG."""
    index = [j for j, row in enumerate(rows) if row.seed is not None]
    if not index:
        return torch.empty_like(like).exponential_()
    seeds = [row.seed for row in rows if row.seed is not None]
    steps = [rows[j].num_output_tokens for j in index]
    noise = seeded_exponential(seeds, steps, like.shape[1], like.device)
    if len(index) == len(rows):
        return noise
    q = torch.empty_like(like).exponential_()
    q[to_device(index, torch.int64, like.device)] = noise
    return q


def sample_rows(
    logits: torch.Tensor, rows: Sequence[SamplingRow], index: Sequence[int], tokens: torch.Tensor
) -> None:
    """Sample rows `index` of `logits` (none greedy) into `tokens` [rows] int64.

    logits: [rows, vocab] float32 after penalties; not modified. Batches with top-k or top-p
    on CUDA: one fused launch that sorts nothing (`pagedq.ops.sampling.fused_sample`). Others,
    and every batch elsewhere: PyTorch ops with `_exponential_noise` (temperature and min-p
    alone cost less host time that way on an H200 host: 0.42 against 0.57 ms at B=256).
    """
    chosen = [rows[i] for i in index]
    params = [row.params for row in chosen]
    shared = _all_alike(params)
    if fused_available(logits) and any(
        p.top_k is not None or p.top_p < 1.0 for p in (params[:1] if shared else params)
    ):
        _fused_sample_rows(logits, chosen, params, shared, index, tokens)
        return
    if shared:
        one, n = params[0], len(params)
        temperature, top_k = [one.temperature] * n, [one.top_k] * n
        top_p, min_p = [one.top_p] * n, [one.min_p] * n
    else:
        temperature, top_k = [p.temperature for p in params], [p.top_k for p in params]
        top_p, min_p = [p.top_p for p in params], [p.min_p for p in params]
    # the rows' index goes to the device once, for the gather and the scatter
    where = None if len(index) == len(rows) else to_device(index, torch.int64, logits.device)
    x = logits if where is None else logits[where]
    picked = reference_sample(x, temperature, top_k, top_p, min_p, _exponential_noise(x, chosen))
    if where is None:
        tokens.copy_(picked)
    else:
        tokens[where] = picked


def _fused_sample_rows(
    logits: torch.Tensor,
    chosen: list[SamplingRow],
    params: list[SamplingParams],  # chosen's
    shared: bool,  # whether every row has the first params (`_all_alike`)
    index: Sequence[int],
    tokens: torch.Tensor,
) -> None:
    first, vocab = params[0], logits.shape[1]
    if shared:  # no per-row reads
        one = (first.temperature, first.top_k or vocab, first.top_p, first.min_p)
        values = np.array([one]).repeat(len(params), axis=0)  # [n, 4] float64 (exact ints)
    else:
        values = np.array([(p.temperature, p.top_k or vocab, p.top_p, p.min_p) for p in params])
    seeds, steps = _seeds_and_steps(chosen)
    temperature, top_k, top_p, min_p = values.T
    fused_sample(logits, index, temperature, top_k, top_p, min_p, seeds, steps, tokens)


def _seeds_and_steps(rows: Sequence[SamplingRow]) -> tuple[np.ndarray, np.ndarray]:
    """The fused sampler's noise keys: a seeded row's (seed, output position); an unseeded
    row's (a draw of the global torch RNG + its place in the batch, 0). The RNG is drawn from
    only when some row is unseeded, as on the PyTorch path."""
    n = len(rows)
    seeds = np.arange(n, dtype=np.int64)
    steps = np.zeros(n, dtype=np.int64)
    unseeded = np.ones(n, dtype=bool)
    for j, row in enumerate(rows):
        if row.seed is not None:
            seeds[j], steps[j], unseeded[j] = row.seed, row.num_output_tokens, False
    if unseeded.any():
        seeds[unseeded] += int(torch.randint(2**62, ()).item())  # + n < 2**63: a valid seed
    return seeds, steps


class Sampler:
    """Turns a batch of logits into one token per row, following each row's params.

    Stateless: randomness comes from the rows' seeds or the global torch RNG. Works on
    CPU and CUDA tensors.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: [num_rows, vocab] float32 (other float dtypes are upcast); not modified."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSample:
        """Queue the sampling of `logits` (as `__call__`) without waiting for the device: the
        tokens stay on the device for the next step's inputs, and `result()` brings
        everything to the host."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if not rows:
            return PendingSample(logits.new_zeros(0, dtype=torch.int64), None, [], 0, None)
        raw = logits.float()
        plan = _BatchPlan.of(rows)
        x = raw
        if plan.min_tokens or plan.repetition or plan.additive:
            x = raw.clone()  # the raw logits stay untouched for the log-probs
            if plan.min_tokens:
                apply_min_tokens(x, rows, plan.min_tokens)
            apply_penalties(x, rows, plan.repetition, plan.additive)
        tokens = self._choose(x, rows, plan.sampled)
        return _start_copy(raw, tokens, plan.num_top, plan.max_top)

    @staticmethod
    def _choose(
        logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]
    ) -> torch.Tensor:
        """[rows] int64: argmax for greedy rows, a sample for rows `sampled`."""
        if len(sampled) == len(rows):
            tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        else:
            tokens = torch.argmax(logits, dim=-1)
        if sampled:
            sample_rows(logits, rows, sampled, tokens)
        return tokens


class PendingSample:
    """The tokens of a queued sampling, on the device, and their copy to the host."""

    def __init__(
        self,
        tokens: torch.Tensor,  # [rows] int64 on the logits' device
        host: torch.Tensor | None,  # [2 + 2 * max_top, rows] float64, filled by the copy
        num_top: list[int | None],  # per row: top log-probs wanted (capped at vocab)
        max_top: int,  # the largest of num_top (0: none)
        copied: torch.cuda.Event | None,  # recorded after the copy (CUDA only)
    ) -> None:
        self.tokens = tokens
        self._host = host
        self._num_top = num_top
        self._max_top = max_top
        self._copied = copied

    def wait(self) -> None:
        """Block until the copy to the host has landed (at once on the CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def result(self) -> SamplerOutput:
        """Wait for the copy; the tokens, their raw log-probs and the top ones as Python
        values."""
        if self._host is None:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        self.wait()
        host, num_top, max_top = self._host, self._num_top, self._max_top
        top_logprobs: list[dict[int, float] | None] = [None] * len(num_top)
        if max_top:
            top_ids = host[2 : 2 + max_top].T.long().tolist()  # [rows][max_top]
            top_values = host[2 + max_top :].T.tolist()  # [rows][max_top]
            for i, k in enumerate(num_top):
                if k is not None:
                    top_logprobs[i] = dict(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        return SamplerOutput(
            token_ids=host[0].long().tolist(),
            logprobs=host[1].tolist(),
            top_logprobs=top_logprobs,
        )


def _start_copy(
    raw: torch.Tensor,  # [rows, vocab] float32 raw logits
    tokens: torch.Tensor,  # [rows] int64
    num_top: list[int | None],  # per row: top log-probs wanted; None
    max_top: int,  # the largest of num_top (0: none)
) -> PendingSample:
    """Raw log-probs of the tokens (and the top ones), and one device -> host copy of it all
    (ids are exact in float64: vocab < 2**53), asynchronous on CUDA (into pinned memory)."""
    vocab = raw.shape[1]
    capped = num_top
    if max_top > vocab:
        capped = [None if k is None else min(k, vocab) for k in num_top]
        max_top = vocab
    values = torch.empty((2 + 2 * max_top, raw.shape[0]), dtype=torch.float64, device=raw.device)
    lse = token_logprobs(raw, tokens, values)  # [rows]
    if max_top:
        top = torch.topk(raw, max_top, dim=-1)  # [rows, max_top]
        values[2 : 2 + max_top] = top.indices.T
        values[2 + max_top :] = (top.values - lse.unsqueeze(1)).T
    if not values.is_cuda:
        return PendingSample(tokens, values, capped, max_top, None)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))  # the copy's stream
    return PendingSample(tokens, host, capped, max_top, copied)
