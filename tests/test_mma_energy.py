"""bench/mma_energy.py without a GPU: the operands each row feeds its instruction."""

from __future__ import annotations

import pytest
import torch

from bench import mma_energy
from bench.mma_energy import A_FORMS, KINDS, SETS, Kind, operands


def kind(name: str) -> Kind:
    return next(k for k in KINDS if k.name == name)


def words(kind_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A's and B's words of 3 threads' operand sets."""
    ops = operands(3, kind(kind_name), torch.Generator().manual_seed(1))
    assert ops.shape == (3, SETS, 6) and ops.dtype == torch.int32
    return ops[..., :4].contiguous(), ops[..., 4:].contiguous()


def is_small_int(values: torch.Tensor) -> bool:
    v = values.float()
    return bool((v == v.round()).all() and v.min() >= -8 and v.max() <= 7)


def test_fp16_rows_put_the_weights_in_a_and_the_activations_in_b() -> None:
    a, b = words("hmma")
    assert is_small_int(a.view(torch.float16))
    assert not is_small_int(b.view(torch.float16))


def test_swapped_and_zero_rows() -> None:
    a, b = words("hmma, x as A")
    assert is_small_int(b.view(torch.float16)) and not is_small_int(a.view(torch.float16))
    a, b = words("hmma, B = 0")
    assert is_small_int(a.view(torch.float16)) and bool((b == 0).all())


def test_int8_row_packs_signed_bytes() -> None:
    a, b = words("imma")
    assert is_small_int(a.view(torch.int8))
    assert int(b.view(torch.int8).min()) < -8  # the activations' bytes span the full range


@pytest.mark.skipif(torch.cuda.is_available(), reason="the script runs on a GPU here")
def test_main_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert mma_energy.main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_forms_carry_the_nibble() -> None:
    """Each fp16 form of A maps q = 0..15 to the value its name says, exactly."""
    q = torch.arange(16)
    assert torch.equal(A_FORMS["q - 8"](q).float(), (q - 8).float())
    assert torch.equal(A_FORMS["q"](q).float(), q.float())
    assert torch.equal(A_FORMS["1024 + q"](q).float(), (q + 1024).float())
    assert torch.equal(A_FORMS["q * 2^-24"](q).float(), q.float() * 2.0**-24)


def test_same_tile_rows_repeat_one_warp_tile() -> None:
    """Every warp and set holds lane i's words of one tile; the other operand still varies."""
    ops = operands(96, kind("hmma, one B tile in every warp"), torch.Generator().manual_seed(2))
    a, b = ops[..., :4], ops[..., 4:]
    assert torch.equal(b, b[:32, :1].repeat(3, SETS, 1))
    assert not torch.equal(b[0, 0], b[1, 0])  # lanes differ within the tile
    assert not torch.equal(a[0, 0], a[32, 0])
    both = operands(64, kind("hmma, one A and one B tile in every warp"), torch.Generator())
    assert torch.equal(both, both[:32, :1].repeat(2, SETS, 1))


def significant_bits(values: torch.Tensor) -> int:
    """The most significant bits any nonzero value needs."""
    mant, exp = torch.frexp(values.double())
    bits = 0
    while bool(torch.ldexp(mant, torch.full_like(exp, bits)).frac().any()):
        bits += 1
    return bits


def test_rounded_b_rows_keep_the_bits_they_name() -> None:
    _, full = words("hmma")
    assert significant_bits(full.view(torch.float16)) == 11
    for bits in (8, 4):
        a, b = words(f"hmma, B to {bits} significant bits" + (" (bf16's)" if bits == 8 else ""))
        assert is_small_int(a.view(torch.float16))
        assert significant_bits(b.view(torch.float16)) == bits


def test_bf16_row_feeds_bf16_operands() -> None:
    a, b = words("hmma bf16")
    assert is_small_int(a.view(torch.bfloat16))
    assert not is_small_int(b.view(torch.bfloat16))
    assert significant_bits(b.view(torch.bfloat16)) == 8
