"""The fused layer ops (RMSNorm with residual add, rotary, SiLU-mul) against their references:
through the Triton interpreter on CPU, on the GPU (with bf16) where CUDA is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.errors import ConfigError
from pagedq.layers.rotary import inverse_frequencies
from pagedq.ops import fused
from tests.tiny_models import make_tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# The kernels round where the references round; what remains is fp32 summation order (norm)
# and one rounding instead of two or three (rotary): a unit or two in the last place.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch):
    def select(name: str) -> None:
        monkeypatch.setenv(fused.BACKEND_ENV, name)

    return select


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_and_residual_add(backend, dtype: torch.dtype, hidden: int) -> None:
    x, residual = randn(7, hidden, dtype=dtype), randn(7, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    backend("triton")
    out = fused.rms_norm(x, weight, 1e-6)
    normed, total = fused.add_rms_norm(x, residual, weight, 1e-6)
    backend("torch")
    torch.testing.assert_close(out, fused.rms_norm(x, weight, 1e-6), **TOL[dtype])
    ref_normed, ref_total = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, ref_total)  # one rounded add on both sides
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (9, 3, 64), (4, 4, 128)])
def test_rotary_rotates_strided_views_in_place(
    backend, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens = 6
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 17, 255, 4095, 70000], device=DEVICE)
    inv_freq = inverse_frequencies(head_dim, 10000.0, None).to(DEVICE)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    backend("torch")
    ref_q, ref_k = fused.rotary_embedding(positions, *views(qkv.clone()), inv_freq)
    backend("triton")
    kernel_qkv = qkv.clone()
    q, k = fused.rotary_embedding(positions, *views(kernel_qkv), inv_freq)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    in_place_q, _ = views(kernel_qkv)
    assert torch.equal(in_place_q, q)  # rotated in the qkv buffer; v untouched
    assert torch.equal(
        kernel_qkv[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (9, 3, 80), (4, 4, 128)])
def test_rotary_with_the_kv_write_matches_the_two_ops(
    backend, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, heads: int, kv_heads: int,
    head_dim: int,
) -> None:  # fmt: skip
    tokens, block_size, num_blocks = 6, 4, 5
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 17, 255, 4095, 70000], device=DEVICE)
    slots = torch.tensor([3, 4, -1, 19, 8, 0], device=DEVICE)  # -1: a padding row, not written
    inv_freq = inverse_frequencies(head_dim, 10000.0, None).to(DEVICE)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    stale = randn(2, *cache_shape, dtype=dtype, seed=3)

    def run(fused_backend: str) -> tuple[torch.Tensor, ...]:
        backend(fused_backend)
        monkeypatch.setenv("PAGEDQ_ATTENTION_BACKEND", fused_backend)
        q, k, v = qkv.clone().split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        kv_cache = (stale[0].clone(), stale[1].clone())
        q = fused.rotary_write_kv(
            positions, q, k, v.view(tokens, kv_heads, head_dim), inv_freq, kv_cache, slots
        )
        return q, *kv_cache

    ref_q, ref_k_cache, ref_v_cache = run("torch")
    q, k_cache, v_cache = run("triton")
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_k_cache, **TOL[dtype])
    assert torch.equal(v_cache, ref_v_cache)  # v is copied as it is
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[[3, 4, 19, 8, 0]] = False
    flat = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[untouched], stale[0].view(-1, kv_heads, head_dim)[untouched])


def test_rotary_with_the_kv_write_checks_the_cache(backend) -> None:
    backend("triton")
    q, k = randn(2, 4, 64, dtype=torch.float32), randn(2, 2, 64, dtype=torch.float32)
    inv_freq = inverse_frequencies(64, 10000.0, None).to(DEVICE)
    cache = randn(3, 4, 2, 32, dtype=torch.float32)  # head_dim 32, not 64
    positions = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="to match the cache"):
        fused.rotary_write_kv(positions, q, k, k.clone(), inv_freq, (cache, cache), positions)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 704, 2048])
def test_silu_mul(backend, dtype: torch.dtype, inter: int) -> None:
    x = randn(5, 2 * inter, dtype=dtype) * 3
    backend("triton")
    out = fused.silu_mul(x)
    backend("torch")
    torch.testing.assert_close(out, fused.silu_mul(x), **TOL[dtype])


def test_empty_batches(backend) -> None:
    backend("triton")
    x = randn(0, 64, dtype=torch.float32)
    assert fused.rms_norm(x, randn(64, dtype=torch.float32), 1e-6).shape == (0, 64)
    assert fused.silu_mul(x).shape == (0, 32)


def test_bad_inputs_name_the_mismatch(backend) -> None:
    backend("torch")
    x = randn(3, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, randn(32, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        fused.add_rms_norm(
            x, randn(3, 32, dtype=torch.float32), randn(64, dtype=torch.float32), 0.1
        )
    with pytest.raises(ValueError, match="2 \\* inter"):
        fused.silu_mul(randn(3, 63, dtype=torch.float32))
    q, k = randn(3, 4, 16, dtype=torch.float32), randn(3, 2, 16, dtype=torch.float32)
    positions = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="q and k must be"):
        fused.rotary_embedding(positions, q[0], k, torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="q and k must be"):
        fused.rotary_embedding(positions, q, k[:, :, :8], torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="inv_freq"):
        fused.rotary_embedding(positions, q, k, torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="positions"):
        fused.rotary_embedding(positions.float(), q, k, torch.ones(8, device=DEVICE))
    backend("fast")
    with pytest.raises(ConfigError, match="PAGEDQ_FUSED_BACKEND='fast'"):
        fused.silu_mul(x)


def test_engine_with_fused_kernels_gives_the_reference_tokens(
    tmp_path: Path, backend, one_thread: None
) -> None:
    folder = make_tiny_llama(tmp_path / "m", hidden_size=64, num_heads=4, num_kv_heads=2)
    prompts = [[5, 9, 33, 2, 100], [7] * 20, [11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for name in ("torch", "triton"):
        backend(name)
        llm = LLM(str(folder), device=DEVICE, dtype="float32", num_blocks=32)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs["triton"] == runs["torch"]
