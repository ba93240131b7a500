"""The batched sampler: filters, penalties, min_tokens, seeds, log-probs, distributions.

Tests that take a `device` run on the CPU and, marked `gpu`, on CUDA when present.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedq.layers.sampler import Sampler, SamplingRow, _BatchPlan, apply_penalties
from pagedq.ops.sampling import apply_min_p, apply_top_k_top_p
from pagedq.sampling_params import SamplingParams

_NO_CUDA = not torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(_NO_CUDA, reason="needs CUDA")]
    ),
]
GREEDY = SamplingParams(temperature=0.0)


def make_row(
    params: SamplingParams = GREEDY,
    *,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: int | None = None,
    stop: Iterable[int] = (),
) -> SamplingRow:
    tokens = [*prompt, *output]
    return SamplingRow(params, tokens, len(prompt), seed, frozenset(stop))


def seeded_row(seed: int, **params: object) -> SamplingRow:
    """A sampled row with its own seed, as the engine builds it for completion 0."""
    return make_row(SamplingParams(seed=seed, **params), seed=seed)  # type: ignore[arg-type]


def kept(logits: torch.Tensor) -> list[set[int]]:
    """Per row, the ids a filter left finite."""
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# --- filters --------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest_per_row() -> None:
    logits = torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0]] * 4)
    out = apply_top_k_top_p(logits, [2, None, 1, 99], [1.0] * 4)
    assert kept(out) == [{0, 4}, {0, 1, 2, 3, 4}, {0}, {0, 1, 2, 3, 4}]
    assert torch.equal(out[0, [0, 4]], logits[0, [0, 4]])  # kept logits are unchanged
    assert torch.isfinite(logits).all()  # the input is not modified


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert kept(apply_top_k_top_p(logits, [2], [1.0])) == [{1, 2}]
    assert kept(apply_top_k_top_p(logits, [1], [1.0])) == [{1, 2}]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, {2}),
        (0.4, {2}),
        (0.7, {2, 0}),
        (0.85, {2, 0, 3}),
        (0.99, {2, 0, 3, 1}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p: float, expected: set[int]) -> None:
    # probabilities 0.3, 0.05, 0.5, 0.15: descending order is ids 2, 0, 3, 1
    logits = torch.tensor([log_probs(0.3, 0.05, 0.5, 0.15)])
    assert kept(apply_top_k_top_p(logits, [None], [top_p])) == [expected]


def test_top_p_renormalises_after_top_k() -> None:
    # After top-k=2 the probabilities are 4/7 and 3/7: top_p=0.5 keeps only the first. On the
    # raw distribution (0.4 then 0.3) it would keep both.
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1)] * 2)
    out = apply_top_k_top_p(logits, [2, None], [0.5, 0.5])
    assert kept(out) == [{0}, {0, 1}]


def test_top_p_rows_are_independent() -> None:
    logits = torch.tensor([log_probs(0.6, 0.3, 0.1), log_probs(0.1, 0.2, 0.7)])
    out = apply_top_k_top_p(logits, [None, 2], [0.8, 1.0])
    assert kept(out) == [{0, 1}, {1, 2}]


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, {0, 1, 2, 3}), (0.05, {0, 1, 2, 3}), (0.35, {0, 1}), (0.7, {0}), (1.0, {0})],
)
def test_min_p_keeps_tokens_above_fraction_of_max(min_p: float, expected: set[int]) -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p=0.35 keeps p >= 0.175
    logits = torch.tensor([log_probs(0.5, 0.3, 0.15, 0.05)])
    assert kept(apply_min_p(logits, [min_p])) == [expected]


# --- penalties and min_tokens ---------------------------------------------------------------


def test_penalties_change_the_right_logits_by_the_right_amounts() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 3)
    prompt, output = [0, 1], [1, 3, 3]
    rows = [
        make_row(SamplingParams(repetition_penalty=2.0), prompt=prompt, output=output),
        make_row(
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
            prompt=prompt,
            output=output,
        ),
        make_row(SamplingParams(), prompt=prompt, output=output),
    ]
    apply_penalties(logits, rows, [0], [1])
    # repetition over prompt+output {0, 1, 3}: 2/2, -1*2, 3/2; ids 2 and 4 unseen
    assert logits[0].tolist() == [1.0, -2.0, 0.5, 1.5, -2.0]
    # output counts {1: 1, 3: 2}: id 1 -= 0.5 + 0.25, id 3 -= 0.5 + 2 * 0.25; prompt id 0 untouched
    assert logits[1].tolist() == [2.0, -1.75, 0.5, 2.0, -2.0]
    assert logits[2].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]


def test_negative_penalties_raise_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    row = make_row(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), output=[0, 0])
    apply_penalties(logits, [row], [], [0])
    assert logits.tolist() == [[2.0, 1.0, 2.0]]


def test_ids_outside_the_vocab_are_ignored_by_penalties() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    row = make_row(params, prompt=[0, 7], output=[2, 3])
    apply_penalties(logits, [row], [0], [0])
    assert logits.tolist() == [[0.5, -1.0, 0.0]]  # id 2: 2 / 2 - 1


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_steer_greedy_but_logprobs_stay_raw(device: str) -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0]], device=device)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=1)
    out = Sampler()(logits, [make_row(penalised, prompt=[0]), make_row(GREEDY, prompt=[0])])
    assert out.token_ids == [1, 0]  # 3 / 1.5 = 2 < 2.5
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert out.logprobs[0] == pytest.approx(raw[1].item(), abs=1e-6)
    assert out.top_logprobs[0] == pytest.approx({0: raw[0].item()}, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_suppresses_stop_ids(device: str) -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0, 7.0]] * 4, device=device)
    params = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [
        make_row(params, output=[3, 3], stop=[1, 2]),  # 2 < 3 tokens: 1 and 2 masked
        make_row(params, output=[3, 3, 3], stop=[1, 2]),  # min_tokens reached
        make_row(params, output=[], stop=[1, 100]),  # ids beyond the vocab are ignored
        make_row(GREEDY, output=[], stop=[1]),  # min_tokens = 0
    ]
    assert Sampler()(logits, rows).token_ids == [4, 1, 2, 1]


def test_min_tokens_suppresses_stop_ids_when_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(500, 4)
    params = SamplingParams(min_tokens=1)
    out = Sampler()(logits, [make_row(params, stop=[0, 2]) for _ in range(500)])
    assert set(out.token_ids) == {1, 3}


# --- greedy, temperature, seeds ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_and_ties_go_to_the_lowest_id(device: str) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 5.0, 5.0]], device=device)
    assert Sampler()(logits, [make_row(), make_row()]).token_ids == [1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_near_zero_equals_greedy(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 100).to(device)
    cold = [make_row(SamplingParams(temperature=1e-4)) for _ in range(64)]
    expected = torch.argmax(logits, dim=-1).tolist()
    assert Sampler()(logits, cold).token_ids == expected
    assert Sampler()(logits, [make_row() for _ in range(64)]).token_ids == expected


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_greedy_rows_take_argmax(device: str) -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 50).to(device)
    top1 = SamplingParams(top_k=1)
    rows = [make_row() if i % 2 else make_row(top1) for i in range(6)]
    assert Sampler()(logits, rows).token_ids == torch.argmax(logits, dim=-1).tolist()


def _run_steps(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], steps: int = 4
) -> list[list[int]]:
    """Token ids of `steps` calls on the same logits and rows, each row's token appended after
    each call (as the engine does: a seeded row's next draw is at its next position)."""
    out = []
    for _ in range(steps):
        ids = sampler(logits, rows).token_ids
        for row, token in zip(rows, ids, strict=True):
            row.token_ids.append(token)  # type: ignore[attr-defined]
        out.append(ids)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_seeds_are_reproducible_and_independent_of_the_batch(device: str) -> None:
    torch.manual_seed(3)
    flat = torch.zeros(1, 1000, device=device)  # uniform: every draw is informative
    sampler = Sampler()
    params = {"top_p": 0.9, "temperature": 0.8}

    def alone(seed: int) -> list[int]:
        return [step[0] for step in _run_steps(sampler, flat, [seeded_row(seed, **params)])]

    batch = [  # other rows around, seeds in another order, other params
        make_row(SamplingParams()),
        seeded_row(8, **params),
        make_row(),
        seeded_row(7, **params),
        make_row(SamplingParams(top_k=3, min_p=0.1)),
    ]
    mixed = _run_steps(sampler, flat.expand(5, 1000), batch)
    assert [step[3] for step in mixed] == alone(7)
    assert [step[1] for step in mixed] == alone(8)
    assert alone(7) == alone(7)
    assert alone(7) != alone(8)
    assert len(set(alone(7))) > 1  # each position draws anew


@pytest.mark.parametrize("device", DEVICES)
def test_unseeded_rows_differ_across_calls(device: str) -> None:
    logits = torch.zeros(8, 1000, device=device)
    rows = [make_row(SamplingParams()) for _ in range(8)]
    first, second = Sampler()(logits, rows).token_ids, Sampler()(logits, rows).token_ids
    assert first != second  # equal with probability 1000**-8


# --- log-probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_equal_log_softmax_of_raw_logits(device: str) -> None:
    torch.manual_seed(4)
    logits = (torch.randn(4, 40) * 3).to(device)
    rows = [
        make_row(
            SamplingParams(temperature=0.5, top_k=5, logprobs=3, frequency_penalty=1.0),
            output=[1, 2],
        ),
        make_row(SamplingParams(temperature=0.0, logprobs=0)),
        make_row(SamplingParams(logprobs=20, min_p=0.2)),
        make_row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1).cpu()
    for i, token in enumerate(out.token_ids):
        # fp32 logsumexp vs fp64 log_softmax: agree to ~1e-6 relative on values of order 10
        assert out.logprobs[i] == pytest.approx(reference[i, token].item(), abs=1e-5)
    for i, k in enumerate([3, 0, 20, None]):
        if k is None:
            assert out.top_logprobs[i] is None
            continue
        values, ids = torch.topk(reference[i], k)
        expected = dict(zip(ids.tolist(), values.tolist(), strict=True))
        assert out.top_logprobs[i] == pytest.approx(expected, abs=1e-5)


def test_top_logprobs_are_capped_at_the_vocab_and_empty_batches_work() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=20))])
    assert out.top_logprobs[0] is not None
    assert list(out.top_logprobs[0]) == [2, 1, 0]
    assert Sampler()(torch.zeros(0, 3), []).token_ids == []


def test_fp16_logits_are_accepted_and_not_modified() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0]], dtype=torch.float16)
    before = logits.clone()
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=5.0), prompt=[1])
    out = Sampler()(logits, [row])
    assert out.token_ids == [0]  # 2 / 5 < 0.5
    assert torch.equal(logits, before)


def test_wrong_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.zeros(3, 5), [make_row(), make_row()])


class _FullWidthOps(TorchDispatchMode):
    """Records the ops that read or write a tensor of `numel` elements (a [rows, vocab] pass)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if any(t.numel() == self.numel for t in tensors):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (GREEDY, {"argmax", "logsumexp", "gather"}),
        (SamplingParams(temperature=0.0, logprobs=3), {"argmax", "logsumexp", "gather", "topk"}),
    ],
)
def test_all_greedy_batch_runs_only_argmax_and_logprob_passes(
    params: SamplingParams, expected: set[str]
) -> None:
    logits = torch.randn(16, 300)
    with _FullWidthOps(logits.numel()) as recorder:
        Sampler()(logits, [make_row(params, prompt=[1], output=[2]) for _ in range(16)])
    assert set(recorder.ops) == expected


def test_batch_plan_groups_rows_by_params_in_batch_order() -> None:
    """The stages' row lists, in batch order: from the params object when every row shares
    one, else row by row (equal params that are distinct objects included)."""
    hot = SamplingParams(temperature=0.7, repetition_penalty=1.2, logprobs=3)
    twin = SamplingParams(temperature=0.7, repetition_penalty=1.2, logprobs=3)
    extra = SamplingParams(temperature=1.0, presence_penalty=0.5, min_tokens=3)
    params = [hot, GREEDY, extra, twin, GREEDY, hot]
    rows = [make_row(p, prompt=[5, 6], output=[7], stop=[1]) for p in params]
    plan = _BatchPlan.of(rows)
    assert plan.sampled == [0, 2, 3, 5]
    assert plan.repetition == [0, 3, 5]
    assert plan.additive == [2]
    assert plan.min_tokens == [2]  # one output token < 3, and stop ids to mask
    assert plan.num_top == [3, None, None, 3, None, 3] and plan.max_top == 3
    uniform = _BatchPlan.of([make_row(extra, output=[7], stop=[1]) for _ in range(3)])
    assert uniform.sampled == uniform.additive == uniform.min_tokens == [0, 1, 2]
    assert uniform.repetition == [] and uniform.num_top == [None] * 3 and uniform.max_top == 0
    copies = [SamplingParams(temperature=1.0, presence_penalty=0.5, min_tokens=3) for _ in "abc"]
    assert _BatchPlan.of([make_row(c, output=[7], stop=[1]) for c in copies]) == uniform
    done = _BatchPlan.of([make_row(extra, output=[7, 8, 9], stop=[1])])
    assert done.min_tokens == []  # three output tokens: min_tokens reached


@pytest.mark.parametrize(
    ("params", "absent"),
    [
        (SamplingParams(), {"clone", "sort", "topk", "amax", "cumsum"}),
        (SamplingParams(top_k=5), {"clone", "sort", "amax", "cumsum"}),
        (SamplingParams(min_p=0.1), {"clone", "sort", "topk", "cumsum"}),
        (SamplingParams(top_p=0.5), {"clone", "topk", "amax"}),
    ],
)
def test_unused_stages_are_skipped(params: SamplingParams, absent: set[str]) -> None:
    logits = torch.randn(16, 300)
    with _FullWidthOps(logits.numel()) as recorder:
        Sampler()(logits, [make_row(params, output=[2]) for _ in range(16)])
    assert not absent & set(recorder.ops)


# --- distributions --------------------------------------------------------------------------


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def _assert_matches(freq: torch.Tensor, probs: torch.Tensor, draws: int) -> None:
    # 5 binomial standard deviations per token: a correct sampler fails with p < 1e-5.
    tolerance = 5 * torch.sqrt(probs * (1 - probs) / draws) + 1e-12
    assert (freq - probs).abs().le(tolerance).all(), (freq, probs)


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies_match_softmax_over_temperature(device: str) -> None:
    torch.manual_seed(5)
    draws, temperature = 20_000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    rows = [make_row(SamplingParams(temperature=temperature))] * draws
    out = Sampler()(base.to(device).expand(draws, 5), rows)
    _assert_matches(_frequencies(out.token_ids, 5), torch.softmax(base.double() / 0.7, 0), draws)


def test_seeded_draws_follow_the_distribution() -> None:
    """Across seeds (one position each), and along the positions of one seed."""
    draws = 4_000
    base = torch.tensor([0.0, 1.0, -1.0, 0.5])
    expected = torch.softmax(base.double(), 0)
    rows = [make_row(SamplingParams(seed=s), seed=s) for s in range(draws)]
    out = Sampler()(base.expand(draws, 4), rows)
    _assert_matches(_frequencies(out.token_ids, 4), expected, draws)
    steps = _run_steps(Sampler(), base.unsqueeze(0), [seeded_row(6)], steps=draws)
    _assert_matches(_frequencies([ids[0] for ids in steps], 4), expected, draws)


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_sampling_follows_the_renormalised_distribution(device: str) -> None:
    torch.manual_seed(7)
    draws = 20_000
    base = torch.tensor(log_probs(0.35, 0.25, 0.2, 0.12, 0.08))
    params = SamplingParams(top_k=4, top_p=0.75)  # top-4 mass 0.92; nucleus: ids 0, 1, 2
    out = Sampler()(base.to(device).expand(draws, 5), [make_row(params)] * draws)
    expected = torch.tensor([0.35, 0.25, 0.2, 0.0, 0.0], dtype=torch.float64) / 0.92
    _assert_matches(_frequencies(out.token_ids, 5), expected / expected.sum(), draws)


# --- CUDA only ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA, reason="needs CUDA")
def test_cuda_matches_cpu_for_greedy_and_logprobs() -> None:
    torch.manual_seed(8)
    logits = torch.randn(32, 32000) * 4
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=5)) for _ in range(32)]
    cpu, cuda = Sampler()(logits, rows), Sampler()(logits.cuda(), rows)
    assert cpu.token_ids == cuda.token_ids
    assert cpu.logprobs == pytest.approx(cuda.logprobs, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA, reason="needs CUDA")
def test_sampled_launch_does_not_wait_for_the_device() -> None:
    """Queuing a step's sampling (temperature, top-k/top-p, min-p, seeded and unseeded rows,
    top log-probs) must not synchronise: with launch-ahead the forward is still running. Small
    per-row tensors go through pinned memory (`pagedq.ops.transfer.to_device`)."""
    logits = torch.randn(8, 1000, device="cuda")
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
        SamplingParams(temperature=0.0),
    ]
    rows = [
        make_row(params[i % 3], output=[3] * i, seed=i if i % 3 == 0 else None) for i in range(8)
    ]
    sampler = Sampler()
    sampler.launch(logits, rows).result()  # warm-up: kernels compiled, pinned blocks cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.launch(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(pending.result().token_ids) == 8
