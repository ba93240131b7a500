"""Seeded sampling noise (pagedq/ops/noise.py): the Philox generator against its published
known answers, the Triton kernel (the interpreter on a CPU, compiled where CUDA is present)
against the PyTorch reference, and the properties the sampler relies on."""

from __future__ import annotations

import pytest
import torch

from pagedq.ops.noise import philox4x32, reference_seeded_exponential, seeded_exponential
from pagedq.ops.triton_loader import load_kernels
from tests.offline_compile import sm90_ptx

# Philox4x32-10 known-answer tests of Random123 (kat_vectors): counter, key -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = [0, 1, 2**40 + 7, 2**63 - 1, 123_456_789]
STEPS = [0, 5, 2**32 - 1, 17, 1_000]


def _words(*values: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_matches_the_published_answers(counter, key, expected) -> None:  # type: ignore[no-untyped-def]
    out = philox4x32(_words(*counter), _words(*key))  # type: ignore[arg-type]
    assert tuple(int(w) for w in out) == expected


@pytest.mark.parametrize("vocab", [3000, 32000])  # a partial last block; Llama's vocab
def test_triton_kernel_matches_the_reference(vocab: int) -> None:
    """The kernel (in the interpreter on a CPU, compiled on a GPU): the same Philox words, so
    the same noise up to the last bits of log."""
    seeds, steps = torch.tensor(SEEDS, device=DEVICE), torch.tensor(STEPS, device=DEVICE)
    got = torch.empty(len(SEEDS), vocab, device=DEVICE)
    load_kernels("triton_kernels.seeded_noise", torch.device(DEVICE)).launch(seeds, steps, got)
    want = reference_seeded_exponential(seeds.cpu(), steps.cpu(), vocab)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    if DEVICE == "cuda":  # and through the op
        op = seeded_exponential(SEEDS, STEPS, vocab, torch.device("cuda"))
        assert torch.equal(op.cpu(), got.cpu())


def test_reference_noise_is_exp1_and_a_function_of_seed_step_and_column() -> None:
    seeds, steps = torch.arange(64), torch.full((64,), 3)
    q = reference_seeded_exponential(seeds, steps, 4000)
    assert q.dtype == torch.float32 and bool((q >= 0).all())
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.03
    alone = reference_seeded_exponential(seeds[5:6], steps[5:6], 1000)
    assert torch.equal(q[5, :1000], alone[0])  # nor on the batch, nor on the vocab size
    assert not torch.equal(alone, reference_seeded_exponential(seeds[5:6], steps[5:6] + 1, 1000))
    assert not torch.equal(alone, reference_seeded_exponential(seeds[6:7], steps[5:6], 1000))


def test_cpu_noise_is_exp1_and_a_function_of_seed_and_step() -> None:
    cpu = torch.device("cpu")
    q = seeded_exponential(list(range(64)), [3] * 64, 4000, cpu)
    assert q.dtype == torch.float32 and bool((q >= 0).all())
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.03
    alone = seeded_exponential([5], [3], 4000, cpu)
    assert torch.equal(q[5], alone[0])  # the rest of the batch does not matter
    assert not torch.equal(alone, seeded_exponential([5], [4], 4000, cpu))  # the next position
    assert not torch.equal(alone, seeded_exponential([6], [3], 4000, cpu))  # another seed


@pytest.mark.parametrize(
    ("seeds", "steps", "match"), [([-1], [0], "seed -1"), ([0], [2**32], "step")]
)
def test_out_of_range_values_are_refused(seeds, steps, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        seeded_exponential(seeds, steps, 10, torch.device("cpu"))


def test_kernel_compiles_for_sm90() -> None:
    """Compile the kernel for an H100/H200 offline, in a fresh process."""
    signature = {"seeds_ptr": "*i64", "steps_ptr": "*i64", "out_ptr": "*fp32", "VOCAB": "i32"}
    [ptx] = sm90_ptx(
        "triton_kernels.seeded_noise",
        [("_seeded_exponential_kernel", signature, {"BLOCK": 1024}, 4)],
    )
    assert "mul.hi.u32" in ptx
