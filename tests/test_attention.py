"""Paged attention ops on CPU: references vs a naive oracle, Triton kernels (interpreted) vs
the references, KV write, dispatch and input checks.

Every batch is built from contiguous per-sequence K/V written into shuffled pages of a pool
whose other slots hold NaN, so reading a slot past a sequence's length poisons the output.
Kernel outputs (and the split-K scratch buffers) are allocated by torch.empty under
`fill_uninitialized_memory`, i.e. pre-filled with NaN, so an unwritten element fails too.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagedq.errors import ConfigError
from pagedq.ops import attention as attn
from pagedq.ops.attention import AttentionMetadata

# fp32: kernels and references both compute in fp32 and differ only in summation order.
# fp16: the kernels round P to fp16 before P @ V (relative 2^-11 per term, as flash
# attention does) and both round the output to fp16 (one ulp is 2e-3 at |x| ~ 2-4).
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},  # as fp16, with bf16's 2^-8 rounding
}


@dataclass
class PagedBatch:
    """Sequences stored in shuffled pages, plus the same K/V contiguous (the ground truth)."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN off-sequence
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator(device).manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    tables = torch.zeros(len(seq_lens), max([*need, 1]) + 1, dtype=torch.int32, device=device)
    pool = torch.randperm(num_blocks, generator=gen, device=device)
    keys, values, used = [], [], 0
    for i, n in enumerate(seq_lens):
        pages, used = pool[used : used + need[i]], used + need[i]
        tables[i, : need[i]] = pages.int()
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        pos = torch.arange(n, device=device)
        slots = pages[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return PagedBatch(k_cache, v_cache, tables, lens, keys, values)


def naive_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: the last n positions of the context
    k: torch.Tensor,  # [L, num_kv_heads, head_dim]
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim] fp32
    """Contiguous causal attention with torch SDPA (math), K/V repeated per query head."""
    n, num_heads, _ = q.shape
    seq_len, group = k.shape[0], num_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - n)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), kf, vf, attn_mask=mask, scale=scale
    )  # [H, n, D]
    return out.transpose(0, 1)


def query_start_loc(q_lens: list[int], device: str = "cpu") -> torch.Tensor:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def naive_batch(batch: PagedBatch, q: torch.Tensor, q_lens: list[int], scale: float):
    starts = query_start_loc(q_lens).tolist()
    parts = [
        naive_attention(q[starts[i] : starts[i + 1]], batch.keys[i], batch.values[i], scale)
        for i in range(len(q_lens))
    ]
    return torch.cat(parts)


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch):
    def select(name: str) -> None:
        monkeypatch.setenv(attn.BACKEND_ENV, name)

    return select


@pytest.fixture
def poison_empty() -> Iterator[None]:
    """torch.empty returns NaN-filled tensors while the test runs."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    yield
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn)
    torch.utils.deterministic.fill_uninitialized_memory = was_fill  # type: ignore[attr-defined]


def lengths_around(block_size: int) -> list[int]:
    """The edge lengths of a page size, and one long context."""
    return [1, block_size - 1, block_size, block_size + 1, 300]


# ---------------------------------------------------------------------------------------
# references vs the naive oracle
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_decode_matches_naive(group: int, block_size: int) -> None:
    batch = make_batch(lengths_around(block_size), 2, 64, block_size, torch.float32)
    q = torch.randn(5, 2 * group, 64)
    out = attn.reference_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125
    )
    torch.testing.assert_close(out, naive_batch(batch, q, [1] * 5, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_prefill_matches_naive(dtype: torch.dtype) -> None:
    # fresh prompt, prefix hit (one cached page), chunk after an unaligned earlier chunk,
    # one decode-like query over a long context, the whole long context as one prompt
    seq_lens, q_lens = [17, 16 + 15, 2 * 16 + 3 + 20, 300, 70], [17, 15, 20, 1, 70]
    batch = make_batch(seq_lens, 3, 64, 16, dtype)
    q = torch.randn(sum(q_lens), 9, 64).to(dtype)
    out = attn.reference_prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
        query_start_loc(q_lens), 0.125,
    )  # fmt: skip
    expected = naive_batch(batch, q, q_lens, 0.125).to(dtype)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_reference_rejects_context_shorter_than_queries() -> None:
    batch = make_batch([4], 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="seq_len 4 is shorter than its 5 queries"):
        attn.reference_prefill_attention(
            torch.randn(5, 1, 16), batch.k_cache, batch.v_cache, batch.block_tables,
            batch.seq_lens, query_start_loc([5]), 1.0,
        )  # fmt: skip


def test_reference_rejects_lengths_beyond_the_block_table() -> None:
    batch = make_batch([20], 1, 16, 16, torch.float32)
    too_long = torch.tensor([16 * batch.block_tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="the block tables hold"):
        attn.reference_decode_attention(
            torch.randn(1, 1, 16), batch.k_cache, batch.v_cache, batch.block_tables, too_long, 1.0
        )


# ---------------------------------------------------------------------------------------
# decode kernel (interpreted) vs the reference
# ---------------------------------------------------------------------------------------

# (GQA group, head_dim, block_size, dtype, num_splits): every pair of values appears, the
# split-K path counted as on (num_splits > 1) or off (1, or None: the heuristic's choice,
# 1 for grids this small on CPU)
DECODE_CASES = [
    (1, 64, 16, torch.float32, 1),
    (1, 128, 32, torch.float16, 4),
    (1, 64, 64, torch.float16, None),
    (3, 64, 16, torch.float16, 4),
    (3, 128, 16, torch.float32, 1),
    (3, 64, 32, torch.float32, 4),
    (3, 128, 64, torch.float16, 1),
    (3, 64, 64, torch.float32, 3),
    (4, 64, 64, torch.float32, 4),
    (4, 128, 16, torch.float16, None),
    (4, 64, 32, torch.float16, 1),
    (4, 128, 32, torch.float32, 4),
]


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "num_splits"), DECODE_CASES)
def test_decode_kernel_matches_reference(
    backend, poison_empty, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
    num_splits: int | None,
) -> None:  # fmt: skip
    backend("triton")
    lens = lengths_around(block_size)
    batch = make_batch(lens, 2, head_dim, block_size, dtype, seed=group + head_dim)
    q = torch.randn(len(lens), 2 * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    out = attn.paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[dtype])


def test_decode_kernel_split_and_tiles_smaller_than_a_page(poison_empty) -> None:
    from triton_kernels import paged_decode

    batch = make_batch([1, 63, 64, 65, 200], 1, 32, 64, torch.float32, seed=5)
    q = torch.randn(5, 3, 32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = torch.full_like(q, float("nan"))
    paged_decode.launch(*args, out, 0.2, 5, paged_decode.DecodeConfig(block_n=16))
    torch.testing.assert_close(out, attn.reference_decode_attention(*args, 0.2), **TOL[q.dtype])


def test_decode_kernel_pads_odd_head_dim(backend, poison_empty) -> None:
    backend("triton")
    batch = make_batch([5, 40], 1, 80, 16, torch.float16, seed=7)
    q = torch.randn(2, 2, 80).to(torch.float16)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 80**-0.5)
    out = attn.paged_decode_attention(*args, num_splits=2)
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[torch.float16])


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_decode_empty_context_gives_zeros(backend, name: str) -> None:
    backend(name)
    batch = make_batch([300, 1], 1, 16, 16, torch.float32)  # 300 tokens: two 256-key splits
    seq_lens = torch.tensor([300, 0], dtype=torch.int32)
    for splits in (1, 2):
        out = attn.paged_decode_attention(
            torch.randn(2, 2, 16), batch.k_cache, batch.v_cache, batch.block_tables, seq_lens,
            0.25, num_splits=splits,
        )  # fmt: skip
        assert torch.equal(out[1], torch.zeros(2, 16))
        assert torch.isfinite(out[0]).all()


# ---------------------------------------------------------------------------------------
# prefill kernel (interpreted) vs the reference
# ---------------------------------------------------------------------------------------

# (GQA group, head_dim, block_size, dtype)
PREFILL_CASES = [
    (1, 64, 16, torch.float32),
    (1, 128, 64, torch.float16),
    (3, 64, 32, torch.float16),
    (3, 128, 16, torch.float32),
    (4, 64, 64, torch.float32),
    (4, 128, 32, torch.float16),
    (2, 80, 16, torch.float16),  # head_dim padded to 128 inside the kernel
]


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype"), PREFILL_CASES)
def test_prefill_kernel_matches_reference(
    backend, poison_empty, group: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    backend("triton")
    # fresh prompt of block+1 tokens, prefix hit of one page + block-1 new, a chunk after an
    # unaligned earlier chunk, a single query over a long context, an empty query
    seq_lens = [block_size + 1, 2 * block_size - 1, 2 * block_size + 23, 300, 7]
    q_lens = [block_size + 1, block_size - 1, 20, 1, 0]
    batch = make_batch(seq_lens, 1, head_dim, block_size, dtype, seed=group * head_dim)
    q = torch.randn(sum(q_lens), group, head_dim).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = attn.paged_prefill_attention(*args, query_start_loc(q_lens), max(q_lens), 0.1)
    expected = attn.reference_prefill_attention(*args, query_start_loc(q_lens), 0.1)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_prefill_kernel_long_query_spans_several_tiles(poison_empty) -> None:
    from triton_kernels import paged_prefill

    # 150 new tokens after 37 cached ones: three 64-row query tiles, diagonal bands that
    # start mid-page, and tiles past the shorter second sequence's queries
    seq_lens, q_lens = [37 + 150, 40], [150, 40]
    batch = make_batch(seq_lens, 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(sum(q_lens), 4, 64)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    qsl = query_start_loc(q_lens)
    out = torch.full_like(q, float("nan"))
    cfg = paged_prefill.PrefillConfig(block_m=64, block_n=32)
    paged_prefill.launch(*args, qsl, 150, out, 0.125, cfg)
    torch.testing.assert_close(
        out, attn.reference_prefill_attention(*args, qsl, 0.125), **TOL[torch.float32]
    )


# ---------------------------------------------------------------------------------------
# KV write and the engine's call sequence
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_scatters_and_leaves_other_slots(backend, name: str, dtype: torch.dtype) -> None:
    backend(name)
    k_cache = torch.randn(6, 16, 3, 64).to(dtype)
    v_cache = torch.randn(6, 16, 3, 64).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5 * 16 + 15, 0, 2 * 16 + 7, -1, 3 * 16], dtype=torch.int64)
    qkv = torch.randn(5, 9, 64).to(dtype)  # k and v as strided views of a fused projection
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    attn.write_kv(k, v, k_cache, v_cache, slots)
    written = torch.zeros(6 * 16, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 16, slot % 16], k[t])
            assert torch.equal(v_cache[slot // 16, slot % 16], v[t])
            written[slot] = True
    untouched = ~written.view(6, 16)
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_engine_step_write_then_attend(backend, name: str) -> None:
    """write_kv of the new tokens, then paged_attention: prefill with a prefix, then decode."""
    backend(name)
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    k_cache = torch.full((12, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0]], dtype=torch.int32)
    keys = torch.randn(2, 41, kv_heads, dim)
    values = torch.randn(2, 41, kv_heads, dim)

    def slots(seq: int, positions: range) -> list[int]:
        return [int(tables[seq, p // block_size]) * block_size + p % block_size for p in positions]

    def step(spans: list[range]) -> torch.Tensor:
        q_lens = [len(r) for r in spans]
        q = torch.randn(sum(q_lens), heads, dim)
        k = torch.cat([keys[i, r] for i, r in enumerate(spans)])
        v = torch.cat([values[i, r] for i, r in enumerate(spans)])
        slot_mapping = torch.tensor([s for i, r in enumerate(spans) for s in slots(i, r)])
        attn.write_kv(k, v, k_cache, v_cache, slot_mapping)
        seq_lens = [r.stop for r in spans]
        meta = AttentionMetadata(
            slot_mapping, tables, torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc(q_lens), max(q_lens), max(seq_lens),
        )  # fmt: skip
        out = attn.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
        starts = query_start_loc(q_lens).tolist()
        for i, r in enumerate(spans):
            expected = naive_attention(
                q[starts[i] : starts[i + 1]], keys[i, : r.stop], values[i, : r.stop], dim**-0.5
            )
            torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, **TOL[q.dtype])
        return out

    step([range(0, 20), range(0, 33)])  # prompts
    step([range(20, 40), range(33, 34)])  # second chunk of seq 0 with seq 1's first decode
    step([range(40, 41), range(34, 35)])  # pure decode


# ---------------------------------------------------------------------------------------
# dispatch and input checks
# ---------------------------------------------------------------------------------------


def test_backend_choice(backend) -> None:
    backend("auto")
    assert attn.attention_backend(torch.device("cpu")) == "torch"
    assert attn.attention_backend(torch.device("cuda", 0)) == "triton"
    backend("torch")
    assert attn.attention_backend(torch.device("cuda", 0)) == "torch"
    backend("Triton")
    assert attn.attention_backend(torch.device("cpu")) == "triton"
    backend("cuda")
    with pytest.raises(ConfigError, match=r"PAGEDQ_ATTENTION_BACKEND='cuda'.*'auto', 'triton'"):
        attn.attention_backend(torch.device("cpu"))


def test_triton_backend_runs_the_kernel(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("the reference ran instead of the kernel")

    monkeypatch.setattr(attn, "reference_decode_attention", fail)
    backend("triton")
    batch = make_batch([3], 1, 16, 16, torch.float32)
    out = attn.paged_decode_attention(
        torch.randn(1, 1, 16), batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0
    )
    assert out.shape == (1, 1, 16)


def test_split_plan_follows_the_h200_sweep() -> None:
    """The W4b cases of the 2026-11-29 sweep (132 SMs, 8 KV heads, 128-token tiles, page 16,
    bounds = longest context rounded up): one split where one split was fastest; where 2 to
    8 splits were all ~6% faster than one, a count in that range."""
    from triton_kernels.paged_decode import choose_splits

    assert choose_splits(256, 8, 1536, 128, 132)[0] == 1  # B=256, mean 1001
    assert choose_splits(64, 32, 1536, 128, 132)[0] == 1  # MHA 32/32, B=64, mean 1001
    assert choose_splits(64, 8, 896, 128, 132)[0] == 1  # B=64, mean 559
    assert 2 <= choose_splits(64, 8, 3328, 128, 132)[0] <= 8  # B=64, mean 2191


def test_short_bounds_with_many_programs_take_small_tiles() -> None:
    """The 2026-12-01 sweep (132 SMs, 32 KV heads, bound 256): many programs with short
    contexts need tiles small enough for several programs per SM; long bounds keep the tiles
    of the W4b sweeps."""
    from triton_kernels.paged_decode import DecodeConfig, DecodePlan, decode_plan

    def plan(num_seqs: int, kv_heads: int, bound: int) -> DecodePlan:
        return decode_plan(num_seqs, 32, kv_heads, 128, 16, torch.float16, bound, None, None, 132)

    def tiles(num_seqs: int, kv_heads: int, bound: int) -> tuple[int, int, int]:
        c = plan(num_seqs, kv_heads, bound).constants
        return c["BLOCK_N"], c["num_warps"], c["num_stages"]

    assert plan(64, 32, 256).grid == (64, 32, 1)  # W2, B=64: one split
    assert tiles(64, 32, 256) == (32, 1, 3)
    assert tiles(16, 32, 256) == (64, 2, 3)
    assert tiles(256, 8, 1536) == (128, 4, 2)  # W4b, B=256, mean 1001
    assert tiles(4, 32, 256) == (128, 4, 3) and plan(4, 32, 256).num_splits > 1
    single = plan(1, 32, 256)  # W2, B=1: the reduce launch costs more than it saves
    assert single.num_splits == 1 and tiles(1, 32, 256) == (128, 4, 3)
    assert plan(1, 32, 512).num_splits > 1  # longer bounds split
    assert DecodeConfig() == DecodeConfig(block_n=128, num_warps=4, num_stages=3)


def test_split_plan_fills_the_sms_of_small_batches() -> None:
    from triton_kernels.paged_decode import choose_splits

    splits, chunk = choose_splits(1, 8, 4096, 128, 132)
    assert splits * 8 >= 132 and splits * chunk >= 4096
    assert choose_splits(4, 1, 100, 128, 132) == (1, 128)  # one tile: nothing to split
    assert choose_splits(64, 8, 32768, 128, 1)[0] == 1  # one SM (the interpreter)


@pytest.mark.parametrize(("block_size", "block_n"), [(16, 128), (64, 32), (256, 64), (48, 32)])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
def test_split_chunks_cover_the_bound_on_tile_and_page_boundaries(
    block_size: int, block_n: int, num_splits: int | None
) -> None:
    from triton_kernels.paged_decode import DecodeConfig, decode_plan

    for bound in (1, 100, 1000, 4096, 20000):
        cfg = DecodeConfig(block_n=block_n)
        plan = decode_plan(4, 32, 8, 128, block_size, torch.bfloat16, bound, num_splits, cfg, 132)
        assert plan.chunk_len % block_n == 0 and plan.chunk_len % block_size == 0
        assert (plan.num_splits - 1) * plan.chunk_len < bound <= plan.num_splits * plan.chunk_len
        assert plan.num_splits <= (num_splits or 64)
        assert plan.grid == (4, 8, plan.num_splits)
        assert plan.constants["SPLIT"] == (plan.num_splits > 1)


def test_decode_plan_is_shared_by_nearby_bounds() -> None:
    from triton_kernels import paged_decode

    batch = make_batch([5, 9], 1, 16, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    plans = [
        paged_decode.launch(*args, torch.empty_like(q), 1.0, max_seq_len=n) for n in (10, 11, 128)
    ]
    assert plans[0] is plans[1] is plans[2]  # one cached plan while the bound grows by steps


def test_decode_bound_below_the_lengths_stays_exact(poison_empty) -> None:
    """The last split takes every position past num_splits * chunk_len."""
    from triton_kernels import paged_decode

    batch = make_batch([1, 40, 300, 129], 1, 32, 16, torch.float32, seed=11)
    q = torch.randn(4, 2, 32)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = torch.full_like(q, float("nan"))
    cfg = paged_decode.DecodeConfig(block_n=16)
    plan = paged_decode.launch(*args, out, 0.3, 3, cfg, max_seq_len=20)
    assert (plan.num_splits, plan.chunk_len) == (3, 48)  # the bound is rounded up to 128
    torch.testing.assert_close(out, attn.reference_decode_attention(*args, 0.3), **TOL[q.dtype])


def test_decode_over_shared_prefix_pages(backend, poison_empty) -> None:
    """Sequences whose block tables start with the same pages (a cached system prompt)."""
    backend("triton")
    prefix_pages = 17  # 272 tokens: with 4 splits wanted, 128-key splits, the last crossing
    batch = make_batch([prefix_pages * 16, 30, 7, 16], 1, 64, 16, torch.float16, seed=4)
    tables = torch.zeros(4, prefix_pages + 2, dtype=torch.int32)
    tables[:, :prefix_pages] = batch.block_tables[0, :prefix_pages]  # the shared pages
    tables[1:, prefix_pages:] = batch.block_tables[1:, :2]  # then each row's own pages
    seq_lens = torch.tensor([272, 272 + 30, 272 + 7, 272 + 16], dtype=torch.int32)
    q = torch.randn(4, 4, 64).to(torch.float16)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens, 0.125)
    out = attn.paged_decode_attention(*args, num_splits=4)
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[q.dtype])


def test_kernel_tiles_follow_the_shape() -> None:
    from triton_kernels import paged_decode, paged_prefill
    from triton_kernels.paged_prefill import PrefillConfig

    assert paged_decode.default_config(128) == paged_decode.DecodeConfig(128, 4, 3)
    assert paged_decode.default_config(64, torch.float16).block_n == 128
    assert paged_decode.default_config(128, torch.float32) == paged_decode.DecodeConfig(64, 4, 2)
    assert paged_decode.default_config(256, torch.float32).block_n == 32  # 2 stages in 128 KB
    # one-split W4b plans on 132 SMs: few programs -> 64-token tiles, many -> 2 stages
    plan = functools.partial(paged_decode.decode_plan, num_heads=32, num_kv_heads=8,
                             head_dim=128, block_size=16, dtype=torch.bfloat16,
                             num_splits=None, config=None, num_sms=132)  # fmt: skip
    short, wide, long = (
        plan(64, max_seq_len=640),
        plan(256, max_seq_len=1152),
        plan(64, max_seq_len=2304),
    )
    assert short.num_splits == wide.num_splits == 1 and long.num_splits > 1
    assert (short.constants["BLOCK_N"], short.constants["num_stages"]) == (64, 3)
    assert (wide.constants["BLOCK_N"], wide.constants["num_stages"]) == (128, 2)
    assert (long.constants["BLOCK_N"], long.constants["num_stages"]) == (128, 3)
    assert short.chunk_len >= 640 and short.chunk_len % 64 == 0
    prefill = paged_prefill.default_config
    assert prefill(128, 2048, 2048) == PrefillConfig(128, 64, 4, 3)  # 4 x 2048 new
    assert prefill(128, 512, 512) == PrefillConfig(64, 32, 4, 3)  # 16 x 512 new
    assert prefill(128, 512, 2048) == PrefillConfig(128, 64, 4, 3)  # 1536 cached + 512 new
    assert prefill(128, 512) == PrefillConfig(64, 32, 4, 3)  # no bound: the queries' length
    assert prefill(128, 16, 4096) == PrefillConfig(64, 64, 4, 3)  # short chunk, long context
    assert prefill(256, 4096, 4096).block_m == 64


def _decode_inputs(**changes: object) -> dict[str, object]:
    batch = make_batch([5, 9], 2, 32, 16, torch.float32)
    inputs: dict[str, object] = {
        "q": torch.randn(2, 4, 32),
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens,
        "scale": 1.0,
    }
    inputs.update(changes)
    return inputs


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.randn(2, 4, 16)}, r"q must be \[num_tokens, num_heads, 32\]"),
        ({"q": torch.randn(2, 3, 32)}, "num_heads 3 is not a multiple of num_kv_heads 2"),
        ({"q": torch.randn(3, 4, 32)}, "q has 3 rows for 2 sequences"),
        ({"q": torch.randn(2, 4, 32).half()}, "k_cache is torch.float32 on cpu"),
        ({"q": torch.randn(2, 4, 32).double()}, "dtype torch.float64 is not supported"),
        ({"v_cache": torch.zeros(1, 16, 2, 32)}, "k_cache and v_cache must both be"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables must be int32"),
        ({"seq_lens": torch.tensor([5], dtype=torch.int32)}, r"seq_lens must be int32 \[2\]"),
        ({"num_splits": 0}, "num_splits must be >= 1, got 0"),
    ],
)
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_decode_input_checks(backend, name: str, changes: dict, message: str) -> None:
    backend(name)
    with pytest.raises(ValueError, match=message):
        attn.paged_decode_attention(**_decode_inputs(**changes))  # type: ignore[arg-type]


def test_triton_input_checks(backend) -> None:
    backend("triton")
    wide = torch.zeros(2, 16, 1, 512)
    with pytest.raises(ValueError, match="head_dim 512 exceeds the Triton kernels' limit 256"):
        attn.paged_decode_attention(
            torch.zeros(1, 1, 512), wide, wide, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0,
        )  # fmt: skip
    k_cache = torch.zeros(2, 16, 1, 32)
    v_cache = torch.zeros(2, 1, 16, 32).transpose(1, 2)  # same shape, other strides
    with pytest.raises(ValueError, match="must share strides"):
        attn.write_kv(
            torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), k_cache, v_cache, torch.zeros(1).long()
        )


def test_prefill_and_write_input_checks() -> None:
    batch = make_batch([5, 9], 1, 32, 16, torch.float32)
    args = (torch.randn(6, 2, 32), batch.k_cache, batch.v_cache, batch.block_tables)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32 \[3\]"):
        attn.paged_prefill_attention(*args, batch.seq_lens, torch.tensor([0, 6]), 6, 1.0)
    kv = torch.zeros(2, 1, 32)
    with pytest.raises(ValueError, match=r"slot_mapping must be int64 \[2\]"):
        attn.write_kv(kv, kv, batch.k_cache, batch.v_cache, torch.zeros(3).long())
    with pytest.raises(ValueError, match=r"k and v must both be \[num_tokens, 1, 32\]"):
        attn.write_kv(kv, torch.zeros(2, 2, 32), batch.k_cache, batch.v_cache, torch.zeros(2))
