"""The fused sampling kernel (triton_kernels/sampling.py) against its PyTorch reference
(pagedq/ops/sampling.py) given the same Philox noise: in the Triton interpreter on a CPU,
compiled where CUDA is present; ties, edge settings, the sampler's row mapping, the sm_90
compile."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pagedq.layers.sampler import Sampler, SamplingRow
from pagedq.ops.noise import reference_seeded_exponential
from pagedq.ops.sampling import (
    FUSED_MAX_VOCAB,
    filtered_probs,
    fused_available,
    fused_sample,
    reference_sample,
    token_logprobs,
)
from pagedq.sampling_params import SamplingParams
from tests.offline_compile import sm90_ptx

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fused_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("PAGEDQ_FUSED_BACKEND", "triton")  # the interpreter on a CPU
    yield


def both(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int | None],
    top_p: list[float],
    min_p: list[float],
    seeds: list[int],
    steps: list[int],
) -> tuple[list[int], list[int]]:
    """(fused tokens, reference tokens) of every row, with the same noise."""
    rows = logits.shape[0]
    logits = logits.to(DEVICE)
    got = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    k = [logits.shape[1] if v is None else v for v in top_k]
    fused_sample(logits, range(rows), temperature, k, top_p, min_p, seeds, steps, got)
    noise = reference_seeded_exponential(torch.tensor(seeds), torch.tensor(steps), logits.shape[1])
    want = reference_sample(logits.cpu(), temperature, top_k, top_p, min_p, noise)
    return got.cpu().tolist(), want.tolist()


@pytest.mark.parametrize(
    ("vocab", "rows"), [(1000, 24), (3000, 24), (9000, 8)]
)  # one chunk with a full or a padded block; three chunks
def test_fused_sample_matches_the_reference(vocab: int, rows: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    temperature = [0.6 + 0.1 * (i % 7) for i in range(rows)]
    top_k: list[int | None] = [[None, 5, 50, vocab + 10][i % 4] for i in range(rows)]
    top_p = [[1.0, 0.9, 0.5, 0.95, 0.2, 1.0][i % 6] for i in range(rows)]
    min_p = [[0.0, 0.0, 0.05, 0.2, 0.0][i % 5] for i in range(rows)]
    seeds = [2**62 + 17 * i for i in range(rows)]
    steps = [3 * i for i in range(rows)]
    got, want = both(logits, temperature, top_k, top_p, min_p, seeds, steps)
    assert got == want


def test_top_p_ties_are_kept_in_id_order_and_top_k_keeps_ties() -> None:
    """Four equal best tokens (in three chunks of the kernel's second pass), top_p 0.25: each
    weighs 0.142, so the mass before the third (0.285) reaches top_p: the two lowest ids are
    kept. top_k=2 over three equal best logits keeps all three."""
    draws, vocab = 24, 9000
    best = [10, 4100, 8200, 8990]
    nucleus = torch.full((vocab,), -8.0)
    nucleus[best] = 0.0
    topk = torch.full((vocab,), -1.0)
    topk[[5, 4500, 8999]] = 3.0
    logits = torch.stack([nucleus] * draws + [topk] * draws)
    n = 2 * draws
    top_p, top_k = [0.25] * draws + [1.0] * draws, [None] * draws + [2] * draws
    got, want = both(logits, [1.0] * n, top_k, top_p, [0.0] * n, [7] * n, list(range(n)))
    assert got == want
    assert set(got[:draws]) == {10, 4100}
    assert set(got[draws:]) == {5, 4500, 8999}


def test_extreme_settings_keep_only_the_best_token() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1)) * 2
    best = logits.argmax(dim=-1).tolist()
    top_p, min_p = [1e-6, 1.0, 1.0, 1e-6, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    top_k: list[int | None] = [None, None, 1, 1, None, None]
    temperature = [1.0, 1.0, 1.0, 1.0, 1e-3, 1e-3]
    got, want = both(logits, temperature, top_k, top_p, min_p, [1] * 6, [0] * 6)
    assert got == want == best


def test_sampler_maps_sampled_rows_back_into_a_mixed_batch() -> None:
    """Greedy rows take the argmax; the others are sampled by the fused kernel into their own
    slots, the seeded ones as the reference draws them."""
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)) * 3
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8)
    rows = [
        SamplingRow(greedy if i % 2 else hot, [1, 2, 3 + i], 1, 50 + i, frozenset())
        for i in range(7)
    ]
    out = Sampler()(logits.to(DEVICE), rows).token_ids
    sampled = [0, 2, 4, 6]
    noise = reference_seeded_exponential(torch.tensor([50 + i for i in sampled]),
                                         torch.full((4,), 2), 300)  # fmt: skip
    want = reference_sample(logits[sampled], [0.9] * 4, [None] * 4, [0.8] * 4, [0.0] * 4, noise)
    assert [out[i] for i in sampled] == want.tolist()
    assert [out[i] for i in (1, 3, 5)] == logits[[1, 3, 5]].argmax(dim=-1).tolist()


def test_unseeded_rows_are_sampled_within_their_filters() -> None:
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.7)
    out = Sampler()(logits.to(DEVICE), [SamplingRow(params, [1], 1, None, frozenset())] * 32)
    probs = filtered_probs(logits, [0.8] * 32, [20] * 32, [0.7] * 32, [0.0] * 32)
    assert all(probs[i, t] > 0 for i, t in enumerate(out.token_ids))


def test_out_of_range_seeds_and_large_vocabularies() -> None:
    logits = torch.zeros(1, 10, device=DEVICE)
    tokens = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="seeds must lie in"):
        fused_sample(logits, [0], [1.0], [10], [1.0], [0.0], [-1], [0], tokens)
    assert fused_available(logits)
    assert not fused_available(torch.zeros(1, FUSED_MAX_VOCAB + 1, device="meta"))


@pytest.mark.parametrize("vocab", [300, 9000])  # one chunk; three
def test_token_logprobs_match_logsumexp(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[1, ::3] = -math.inf  # masked ids, as min_tokens leaves them
    tokens = torch.tensor([0, 4, vocab - 1, 7, 2])
    got = torch.zeros(4, 5, dtype=torch.float64, device=DEVICE)
    lse = token_logprobs(logits.to(DEVICE), tokens.to(DEVICE), got)
    monkeypatch.setenv("PAGEDQ_FUSED_BACKEND", "torch")
    want = torch.zeros(4, 5, dtype=torch.float64)
    want_lse = token_logprobs(logits, tokens, want)
    # fp32 sums in another order (and the GPU's fast exp): values of order 20, a few ulps
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5)
    assert got[0].tolist() == tokens.tolist() and not got[2:].any()


def test_kernel_compiles_for_sm90() -> None:
    """Compile both kernels, every stage on, for an H100/H200 offline, in a fresh process."""
    sample = {"logits_ptr": "*fp32", "fparams_ptr": "*fp32", "iparams_ptr": "*i64",
              "tokens_ptr": "*i64", "stride": "i32", "n": "i32", "VOCAB": "i32"}  # fmt: skip
    stages = {"BLOCK": 32768, "CHUNK": 4096, "TOP_K": True, "TOP_P": True, "MIN_P": True}
    logprob = {"logits_ptr": "*fp32", "tokens_ptr": "*i64", "values_ptr": "*fp64",
               "lse_ptr": "*fp32", "stride": "i32", "rows": "i32", "VOCAB": "i32"}  # fmt: skip
    ptx, _ = sm90_ptx(
        "triton_kernels.sampling",
        [("_sample_kernel", sample, stages, 32),
         ("_token_logprob_kernel", logprob, {"CHUNK": 4096}, 8)],
    )  # fmt: skip
    assert "mul.hi.u32" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_fused_sample_matches_the_reference_at_full_size() -> None:
    """256 rows of Llama's 32,000 with the settings users send."""
    rows, vocab = 256, 32000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4)) * 4
    top_k: list[int | None] = [[None, 40][i % 2] for i in range(rows)]
    top_p = [[0.9, 0.95, 1.0][i % 3] for i in range(rows)]
    min_p = [[0.0, 0.0, 0.05, 0.0][i % 4] for i in range(rows)]
    seeds, steps = list(range(rows)), [i * 7 for i in range(rows)]
    got, want = both(logits, [0.8] * rows, top_k, top_p, min_p, seeds, steps)
    assert got == want
