"""GPTQLinear at load and on the torch (reference) path, against independently built checkpoints.

The checkpoint builder below packs with numpy and its own bit arithmetic (not pagedq's
format.py), following gptq-format.md, and dequantizes in float64, so `expected_wt` is an
oracle independent of everything under test. It is reused by the kernel and GPU tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from pagedq.errors import CheckpointError, ConfigError, UnsupportedModelError
from pagedq.gptq.config import GPTQConfig, GPTQTensors
from pagedq.gptq.linear import GPTQLinear
from pagedq.ops.gptq import BACKEND_ENV, gptq_backend, pack_blocks, unpack_blocks

# --- independent checkpoint builder ------------------------------------------------------


def pack_along_rows(q: np.ndarray) -> torch.Tensor:
    """[K, N] values 0..15 -> [K/8, N] int32, element j of a word = input row 8w + j, bits 4j.."""
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint32)
    for j in range(8):
        words |= q[j::8].astype(np.uint32) << np.uint32(4 * j)
    return torch.from_numpy(words.view(np.int32).copy())


def pack_along_cols(z: np.ndarray) -> torch.Tensor:
    """[G, N] values 0..15 -> [G, N/8] int32, element j of a word = column 8w + j."""
    words = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    for j in range(8):
        words |= z[:, j::8].astype(np.uint32) << np.uint32(4 * j)
    return torch.from_numpy(words.view(np.int32).copy())


# zero modes: how zero points are stored
#   v1 / v2: asymmetric, stored nibble + 1 (v1) or as is (v2); v1 includes stored 15 (-> 16)
#   v1_gptqmodel: asymmetric v1 as GPTQModel >= 0.9 writes it (meta.quantizer names it): the
#     v2 word minus 0x11111111, so a zero of 0 borrows from the next nibble
#   sym_v1 (7s), sym_v2 (8s), sym_v1_stores_8 (labelled v1, stores 8s: read as v2)
ZERO_MODES = ("v1", "v2", "v1_gptqmodel", "sym_v1", "sym_v2", "sym_v1_stores_8")
GPTQMODEL = ("gptqmodel:7.6.0",)  # meta.quantizer of a GPTQModel checkpoint


def gptqmodel_v1_words(real_zero: np.ndarray) -> torch.Tensor:
    """GPTQModel's v1 qzeros: each packed word of real zeros minus 0x11111111, modulo 2^32."""
    words = pack_along_cols(real_zero).numpy().view(np.uint32)
    return torch.from_numpy((words - np.uint32(0x11111111)).view(np.int32).copy())


@dataclass(frozen=True)
class Checkpoint:
    tensors: GPTQTensors
    config: GPTQConfig
    expected_wt: torch.Tensor  # [K, N] float64: W^T dequantized by the rules of gptq-format.md


def make_checkpoint(
    seed: int,
    k: int,
    n: int,
    group_size: int = 128,
    zero_mode: str = "sym_v1",
    desc_act: bool = False,
    bias: bool = False,
    g_idx_rng_seed: int | None = None,
) -> Checkpoint:
    """A random 4-bit checkpoint linear (W [n, k]) and its float64 W^T."""
    rng = np.random.default_rng(seed)
    groups = 1 if group_size == -1 else math.ceil(k / group_size)
    q = rng.integers(0, 16, size=(k, n))
    sym = zero_mode.startswith("sym")
    v1 = zero_mode in ("v1", "v1_gptqmodel", "sym_v1", "sym_v1_stores_8")
    if zero_mode in ("sym_v1",):
        stored = np.full((groups, n), 7)
    elif zero_mode in ("sym_v2", "sym_v1_stores_8"):
        stored = np.full((groups, n), 8)
    else:
        stored = rng.integers(0, 16, size=(groups, n))
        stored[:, 0] = 15  # v1 reads 16 here, v2 reads 15
        stored[:, 1] = 0
    real_zero = stored + (1 if v1 and zero_mode not in ("sym_v1_stores_8", "v1_gptqmodel") else 0)
    if zero_mode == "v1_gptqmodel":
        real_zero[:, 1::3] = 0  # zeros of 0 in every word, some in its top nibble
        real_zero[:, 7::8] = 0
        qzeros = gptqmodel_v1_words(real_zero)
    else:
        qzeros = pack_along_cols(stored)
    scales = rng.uniform(0.002, 0.02, size=(groups, n)).astype(np.float16)
    if group_size == -1:
        g_idx = np.zeros(k, dtype=np.int64)
    elif desc_act:
        order = np.random.default_rng(g_idx_rng_seed if g_idx_rng_seed is not None else seed + 1)
        g_idx = order.permutation(k) // group_size
    else:
        g_idx = np.arange(k) // group_size
    wt = scales.astype(np.float64)[g_idx] * (q - real_zero[g_idx])
    tensors = GPTQTensors(
        qweight=pack_along_rows(q),
        qzeros=qzeros,
        scales=torch.from_numpy(scales),
        g_idx=torch.from_numpy(g_idx.astype(np.int32)),
        bias=torch.from_numpy(rng.normal(0, 0.5, n).astype(np.float16)) if bias else None,
    )
    config = GPTQConfig(
        bits=4,
        group_size=None if group_size == -1 else group_size,
        desc_act=desc_act,
        sym=sym,
        checkpoint_format="gptq" if v1 else "gptq_v2",
        quantizer=GPTQMODEL if zero_mode == "v1_gptqmodel" else (),
    )
    return Checkpoint(tensors, config, torch.from_numpy(wt))


def reference_output(x: torch.Tensor, ckpts: list[Checkpoint]) -> torch.Tensor:
    """x @ W^T (+ bias) in float64 for fused parts."""
    wt = torch.cat([c.expected_wt for c in ckpts], dim=1)
    out = x.double() @ wt
    biases = [c.tensors.bias for c in ckpts]
    if any(b is not None for b in biases):
        n = [c.expected_wt.shape[1] for c in ckpts]
        out += torch.cat(
            [
                b.double() if b is not None else torch.zeros(m)
                for b, m in zip(biases, n, strict=True)
            ]
        )
    return out


def test_pack_helper_matches_the_documented_example() -> None:
    q = np.array([3, 15, 0, 8, 7, 1, 12, 5]).reshape(8, 1)
    assert int(pack_along_rows(q).view(torch.int32).numpy().view(np.uint32)[0, 0]) == 0x5C1780F3
    assert int(pack_along_cols(q.T).numpy().view(np.uint32)[0, 0]) == 0x5C1780F3


# --- load: dequantized weights ------------------------------------------------------------


@pytest.mark.parametrize("zero_mode", ZERO_MODES)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("desc_act", [False, True])
def test_dequantized_weight_matches_independent_dequant(
    zero_mode: str, group_size: int, desc_act: bool
) -> None:
    ck = make_checkpoint(
        seed=7, k=256, n=48, group_size=group_size, zero_mode=zero_mode, desc_act=desc_act
    )
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    # fp32 holds (q - z') * s exactly up to one rounding of the product: relative 2**-24
    torch.testing.assert_close(
        lin.dequantized_weight().double(), ck.expected_wt.t(), rtol=1e-7, atol=0
    )


def test_asym_v1_stored_15_reads_as_16() -> None:
    ck = make_checkpoint(seed=3, k=64, n=16, group_size=32, zero_mode="v1")
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    packed, _ = lin.segment(0)
    assert packed.zeros is not None
    assert packed.zeros[:, 0].tolist() == [16.0, 16.0]  # column 0 stores 15
    assert packed.zeros[:, 1].tolist() == [1.0, 1.0]  # column 1 stores 0


def test_gptqmodel_v1_zeros_read_by_whole_word_and_others_by_nibble() -> None:
    ck = make_checkpoint(seed=3, k=64, n=16, group_size=32, zero_mode="v1_gptqmodel")
    assert ck.config.zeros_by_word
    packed, _ = GPTQLinear([ck.tensors], ck.config, torch.float32).segment(0)
    assert packed.zeros is not None
    assert packed.zeros[:, 1].tolist() == [0.0, 0.0] and packed.zeros[:, 7].tolist() == [0.0, 0.0]
    # the same words from another v1 writer (no GPTQModel in meta.quantizer): nibble + 1
    for quantizer in ((), ("gptqmodel:0.8.9",), ("autogptq:0.7.1",)):
        other = replace(ck.config, quantizer=quantizer)
        assert not other.zeros_by_word
        lin = GPTQLinear([ck.tensors], other, torch.float32)
        packed, _ = lin.segment(0)
        assert packed.zeros is not None
        assert packed.zeros[:, 1].tolist() == [16.0, 16.0]  # 0 - 1 left 15 in the nibble
        assert not torch.allclose(lin.dequantized_weight().double(), ck.expected_wt.t())


def test_symmetric_zeros_are_dropped_and_v1_storing_8_reads_as_v2() -> None:
    for mode in ("sym_v1", "sym_v2", "sym_v1_stores_8"):
        ck = make_checkpoint(seed=5, k=128, n=16, zero_mode=mode)
        packed, _ = GPTQLinear([ck.tensors], ck.config, torch.float32).segment(0)
        assert packed.zeros is None, mode  # every z' is 8
    # the same 8s under an asymmetric v1 label mean z' = 9
    ck = make_checkpoint(seed=5, k=128, n=16, zero_mode="sym_v1_stores_8")
    asym = replace(ck.config, sym=False)
    packed, _ = GPTQLinear([ck.tensors], asym, torch.float32).segment(0)
    assert packed.zeros is not None and bool((packed.zeros == 9).all())


def test_act_order_sorts_rows_once_and_keeps_the_permutation() -> None:
    ck = make_checkpoint(seed=11, k=256, n=16, group_size=64, zero_mode="v2", desc_act=True)
    packed, _ = GPTQLinear([ck.tensors], ck.config, torch.float32).segment(0)
    assert packed.perm is not None and packed.group_size == 64
    g_idx = ck.tensors.g_idx
    assert g_idx is not None
    sorted_g = g_idx.long()[packed.perm]
    assert torch.equal(sorted_g, torch.arange(256) // 64)  # contiguous groups after the sort
    plain = make_checkpoint(seed=11, k=256, n=16, group_size=64, zero_mode="v2", desc_act=False)
    assert GPTQLinear([plain.tensors], plain.config, torch.float32).segment(0)[0].perm is None


def test_block_layout_puts_row_32p_2r_h_in_nibble_p_4h_of_word_r() -> None:
    q = torch.randint(0, 16, (200, 8))
    packed = pack_blocks(q)
    assert packed.shape == (256 // 8, 8)  # K padded to a multiple of 128
    words = packed.numpy().view(np.uint32).astype(np.int64)
    for row in range(200):
        block, within = divmod(row, 128)
        p, rest = divmod(within, 32)
        r, h = divmod(rest, 2)
        nibble = (words[16 * block + r] >> (4 * p + 16 * h)) & 0xF
        assert nibble.tolist() == q[row].tolist(), row
    assert not unpack_blocks(packed, 256)[200:].any()  # padded rows hold 0
    assert torch.equal(unpack_blocks(packed, 200), q.int())


# --- fusion -------------------------------------------------------------------------------


def test_parts_with_equal_g_idx_fuse_into_one_segment() -> None:
    parts = [
        make_checkpoint(seed=s, k=128, n=n, zero_mode="v1", bias=s == 1)
        for s, n in ((1, 32), (2, 16), (3, 16))
    ]
    lin = GPTQLinear([p.tensors for p in parts], parts[0].config, torch.float32)
    assert lin.num_segments == 1 and lin.out_features == 64
    torch.testing.assert_close(
        lin.dequantized_weight().double(),
        torch.cat([p.expected_wt for p in parts], 1).t(),
        rtol=1e-7,
        atol=0,
    )
    x = torch.randn(3, 128)
    torch.testing.assert_close(lin(x).double(), reference_output(x, parts), rtol=1e-5, atol=1e-5)


def test_parts_with_different_g_idx_stay_separate_and_concatenate() -> None:
    parts = [
        make_checkpoint(
            seed=s,
            k=256,
            n=24,
            group_size=64,
            zero_mode="v2",
            desc_act=True,
            g_idx_rng_seed=g,
            bias=True,
        )
        for s, g in ((1, 100), (2, 100), (3, 200))
    ]
    lin = GPTQLinear([p.tensors for p in parts], parts[0].config, torch.float32)
    assert lin.num_segments == 2  # parts 0 and 1 share g_idx, part 2 does not
    x = torch.randn(2, 5, 256)
    out = lin(x)
    assert out.shape == (2, 5, 72)
    ref = reference_output(x.reshape(10, 256), parts).reshape(2, 5, 72)
    # fp32 matmul over K=256 of O(1) terms: rounding well below 1e-4
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_forward_on_the_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "torch")
    ck = make_checkpoint(
        seed=21, k=192, n=40, group_size=64, zero_mode="v1", desc_act=True, bias=True
    )
    lin = GPTQLinear([ck.tensors], ck.config, dtype)
    x = torch.randn(7, 192).to(dtype)
    out = lin(x)
    assert out.dtype == dtype and out.shape == (7, 40)
    ref = reference_output(x, [ck])
    # fp32 accumulation; error = output rounding in dtype (and bf16 scales: 2**-9 relative)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


def test_moving_the_module_drops_the_cpu_cache() -> None:
    ck = make_checkpoint(seed=2, k=128, n=16)
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    lin(torch.randn(1, 128))
    assert lin._dense_t is not None
    lin.to(torch.float16)
    assert lin._dense_t is None and lin.segment(0)[0].scales.dtype == torch.float16


# --- load errors --------------------------------------------------------------------------


def _base() -> Checkpoint:
    return make_checkpoint(seed=9, k=128, n=16, group_size=64, zero_mode="v1", bias=True)


def _int(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32)


@pytest.mark.parametrize(
    ("change", "error", "names"),
    [
        (lambda t, c: (t, replace(c, bits=3)), UnsupportedModelError, "bits=3"),
        (lambda t, c: (t, replace(c, pack_dtype="int16")), UnsupportedModelError, "int16"),
        (lambda t, c: (t, replace(c, checkpoint_format="awq")), UnsupportedModelError, "awq"),
        (lambda t, c: (replace(t, qweight=t.qweight.long()), c), CheckpointError, "int64"),
        (lambda t, c: (replace(t, qweight=t.qweight[:, :12]), c), CheckpointError, "N=12"),
        (lambda t, c: (replace(t, qzeros=t.qzeros[:1]), c), CheckpointError, "(1, 2)"),
        (lambda t, c: (replace(t, qzeros=t.qzeros.long()), c), CheckpointError, "int64"),
        (lambda t, c: (replace(t, scales=t.scales[:, :8]), c), CheckpointError, "(2, 8)"),
        (lambda t, c: (replace(t, scales=_int(t.scales)), c), CheckpointError, "int32"),
        (lambda t, c: (replace(t, g_idx=t.g_idx[:120]), c), CheckpointError, "(120,)"),
        (lambda t, c: (replace(t, g_idx=t.g_idx.clone().fill_(2)), c), CheckpointError, "value 2"),
        (
            lambda t, c: (replace(t, g_idx=t.g_idx.clone().fill_(-1)), c),
            CheckpointError,
            "value -1",
        ),
        (lambda t, c: (replace(t, bias=t.bias[:8]), c), CheckpointError, "(8,)"),
        (lambda t, c: (t, replace(c, group_size=32)), CheckpointError, "(4, 2)"),
    ],
)
def test_bad_checkpoints_raise_typed_errors_naming_the_value(change, error, names) -> None:  # type: ignore[no-untyped-def]
    ck = _base()
    tensors, config = change(ck.tensors, ck.config)
    with pytest.raises(error, match=None) as info:
        GPTQLinear([ck.tensors, tensors], config, torch.float16)
    assert names in str(info.value)
    if error is CheckpointError and "bits" not in names:
        assert "part 1" in str(info.value) or "part 0" in str(info.value)


def test_parts_with_different_k_are_rejected() -> None:
    a, b = make_checkpoint(seed=1, k=128, n=16), make_checkpoint(seed=2, k=256, n=16)
    with pytest.raises(CheckpointError, match="K=256"):
        GPTQLinear([a.tensors, b.tensors], a.config, torch.float16)


def test_no_parts_and_bad_dtype_are_rejected() -> None:
    ck = _base()
    with pytest.raises(CheckpointError, match="got 0"):
        GPTQLinear([], ck.config, torch.float16)
    with pytest.raises(ConfigError, match="int8"):
        GPTQLinear([ck.tensors], ck.config, torch.int8)


def test_forward_rejects_wrong_input() -> None:
    ck = _base()
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    with pytest.raises(ValueError, match="64"):
        lin(torch.randn(2, 64))
    with pytest.raises(ValueError, match="float16"):
        lin(torch.randn(2, 128).half())


def test_backend_env_is_validated_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "Torch")
    assert gptq_backend() == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cublas")
    with pytest.raises(ConfigError, match="cublas") as info:
        gptq_backend()
    assert "triton" in str(info.value)
    ck = _base()
    lin = GPTQLinear([ck.tensors], ck.config, torch.float32)
    with pytest.raises(ConfigError):
        lin(torch.randn(1, 128))
