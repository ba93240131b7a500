"""Paged attention kernels on the GPU at full size, against the references (same file layout
and tolerances as tests/test_attention.py), plus CUDA-graph capture and no host syncs.

Run: PYTHONPATH=. python3 -m pytest -m gpu tests/test_attention_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from pagedq.ops import attention as attn
from pagedq.ops.attention import AttentionMetadata
from tests.test_attention import TOL, PagedBatch, make_batch, naive_batch, query_start_loc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(32, 8), (9, 3), (32, 32)]  # (query heads, KV heads): Llama-3-8B, SmolLM2, Llama-2-7B


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attn.BACKEND_ENV, "triton")


def ragged_lengths(block_size: int, longest: int, count: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    edges = [1, block_size - 1, block_size, block_size + 1, longest]
    return edges + torch.randint(1, longest + 1, (count - len(edges),), generator=gen).tolist()


def check_decode(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
    num_splits: int | None,
) -> None:  # fmt: skip
    lens = ragged_lengths(block_size, 4096, 24, seed=heads + head_dim + block_size)
    batch = make_batch(lens, kv_heads, head_dim, block_size, dtype, device="cuda")
    q = torch.randn(len(lens), heads, head_dim, device="cuda").to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, head_dim**-0.5)
    out = attn.paged_decode_attention(*args, num_splits=num_splits, max_seq_len=4096)
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, None])
def test_decode_full_size(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, num_splits: int | None
) -> None:
    check_decode(dtype, heads, kv_heads, head_dim, 16, num_splits)


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [(torch.bfloat16, 32, 8, 128), (torch.float16, 9, 3, 64)],
)
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_block_sizes(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, num_splits: int
) -> None:
    check_decode(dtype, heads, kv_heads, head_dim, block_size, num_splits)


def shared_prefix_batch(
    prefix_len: int, own_lens: list[int], dtype: torch.dtype
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """Pages of a prefix and of each sequence's own tokens; every table row starts with the
    prefix pages (a cached system prompt). Returns the batch, the tables and the lengths."""
    prefix_pages = prefix_len // 16
    batch = make_batch([prefix_len, *own_lens], 8, 128, 16, dtype, device="cuda", seed=9)
    own_pages = max(-(-n // 16) for n in own_lens)
    tables = torch.zeros(len(own_lens), prefix_pages + own_pages, dtype=torch.int32)
    tables[:, :prefix_pages] = batch.block_tables[0, :prefix_pages].cpu()
    tables[:, prefix_pages:] = batch.block_tables[1:, :own_pages].cpu()
    seq_lens = torch.tensor([prefix_len + n for n in own_lens], dtype=torch.int32)
    return batch, tables.cuda(), seq_lens.cuda()


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_shared_prefix_full_size(num_splits: int | None) -> None:
    """The bench's shared case: 64 sequences on one 2048-token prefix, each with own tokens."""
    own = ragged_lengths(16, 270, 64, seed=1)
    batch, tables, seq_lens = shared_prefix_batch(2048, own, torch.bfloat16)
    q = torch.randn(64, 32, 128, device="cuda").to(torch.bfloat16)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens, 128**-0.5)
    out = attn.paged_decode_attention(*args, num_splits=num_splits, max_seq_len=2048 + 270)
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[q.dtype])


def test_decode_length_bound_below_the_lengths_is_still_exact() -> None:
    """A bound far below the real lengths plans few splits; the last one takes the rest."""
    lens = ragged_lengths(16, 4096, 24, seed=2)
    batch = make_batch(lens, 8, 128, 16, torch.bfloat16, device="cuda")
    q = torch.randn(len(lens), 32, 128, device="cuda").to(torch.bfloat16)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5)
    for num_splits in (None, 8):
        out = attn.paged_decode_attention(*args, num_splits=num_splits, max_seq_len=300)
        torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[q.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_seqs", "kv_heads"), [(1, 32), (4, 32), (16, 32), (64, 32), (200, 8)])
def test_decode_short_bound_plans(dtype: torch.dtype, num_seqs: int, kv_heads: int) -> None:
    """Bounds of 256 take the short-context plans (one split for few programs; 64-token
    tiles with 2 warps, or 32-token tiles with 1 warp, for many): each exact."""
    from triton_kernels import paged_decode

    lens = ragged_lengths(16, 256, max(num_seqs, 5), seed=num_seqs)[-num_seqs:]
    batch = make_batch(lens, kv_heads, 128, 16, dtype, device="cuda")
    q = torch.randn(num_seqs, 32, 128, device="cuda").to(dtype)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = torch.full_like(q, float("nan"))
    plan = paged_decode.launch(*args, out, 128**-0.5, max_seq_len=256)
    assert plan.num_splits == 1 or num_seqs == 4
    torch.testing.assert_close(out, attn.reference_decode_attention(*args, 128**-0.5), **TOL[dtype])


# the tiles bench/bench_attention.py sweeps: each must compile, fit and be exact
DECODE_TILES = [
    (128, 4, 3), (128, 4, 2), (64, 2, 3), (64, 4, 3), (128, 8, 3), (64, 2, 2), (32, 1, 3),
]  # fmt: skip
PREFILL_TILES = [
    (128, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3),
    (128, 64, 4, 4), (64, 32, 4, 4), (64, 32, 2, 3),
]  # fmt: skip


@pytest.mark.parametrize(("block_n", "num_warps", "num_stages"), DECODE_TILES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_decode_swept_tiles(
    block_n: int, num_warps: int, num_stages: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    from triton_kernels import paged_decode

    lens = ragged_lengths(16, 3000, 16, seed=block_n + num_stages)
    batch = make_batch(lens, kv_heads, head_dim, 16, torch.bfloat16, device="cuda")
    q = torch.randn(len(lens), heads, head_dim, device="cuda").to(torch.bfloat16)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    expected = attn.reference_decode_attention(*args, head_dim**-0.5)
    cfg = paged_decode.DecodeConfig(block_n, num_warps, num_stages)
    for num_splits in (1, 5):
        out = torch.full_like(q, float("nan"))
        paged_decode.launch(*args, out, head_dim**-0.5, num_splits, cfg, max_seq_len=3000)
        torch.testing.assert_close(out, expected, **TOL[q.dtype])


@pytest.mark.parametrize(("block_m", "block_n", "num_warps", "num_stages"), PREFILL_TILES)
def test_prefill_swept_tiles(block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
    from triton_kernels import paged_prefill

    seq_lens, q_lens = [700, 1333, 129, 40], [700, 333, 128, 1]
    batch = make_batch(seq_lens, 8, 128, 16, torch.bfloat16, device="cuda")
    q = torch.randn(sum(q_lens), 32, 128, device="cuda").to(torch.bfloat16)
    qsl = query_start_loc(q_lens, "cuda")
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, qsl)
    out = torch.full_like(q, float("nan"))
    cfg = paged_prefill.PrefillConfig(block_m, block_n, num_warps, num_stages)
    paged_prefill.launch(*args, max(q_lens), out, 128**-0.5, cfg)
    expected = attn.reference_prefill_attention(*args, 128**-0.5)
    torch.testing.assert_close(out, expected, **TOL[q.dtype])


def check_prefill(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    # fresh prompts, prefix hits, chunks after unaligned earlier chunks, single queries
    seq_lens = [1, 700, 2048, 1000 + 333, 3 * block_size, 4000, 129]
    q_lens = [1, 700, 1500, 333, block_size - 1, 1, 128]
    batch = make_batch(seq_lens, kv_heads, head_dim, block_size, dtype, device="cuda")
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda").to(dtype)
    qsl = query_start_loc(q_lens, "cuda")
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    out = attn.paged_prefill_attention(*args, qsl, max(q_lens), head_dim**-0.5)
    expected = attn.reference_prefill_attention(*args, qsl, head_dim**-0.5)
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_full_size(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    check_prefill(dtype, heads, kv_heads, head_dim, 16)


@pytest.mark.parametrize("block_size", [32, 64])
def test_prefill_block_sizes(block_size: int) -> None:
    check_prefill(torch.bfloat16, 32, 8, 128, block_size)


def test_reference_matches_naive_on_gpu() -> None:
    lens = [1, 17, 500, 2049]
    batch = make_batch(lens, 8, 128, 16, torch.float32, device="cuda")
    q = torch.randn(4, 32, 128, device="cuda")
    out = attn.reference_decode_attention(
        q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5
    )
    torch.testing.assert_close(out, naive_batch(batch, q, [1] * 4, 128**-0.5), **TOL[q.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_full_size(dtype: torch.dtype) -> None:
    k_cache = torch.randn(512, 16, 8, 128, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(512 * 16, device="cuda")[:3000]
    slots[::7] = -1  # skipped
    k = torch.randn(3000, 8, 128, device="cuda").to(dtype)
    v = torch.randn(3000, 8, 128, device="cuda").to(dtype)
    attn.write_kv(k, v, k_cache, v_cache, slots)
    attn.reference_write_kv(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_decode_step_has_no_host_sync_and_replays_in_a_cuda_graph() -> None:
    """Capture write_kv + decode once, then replay it over changed lengths and tables."""
    heads, kv_heads, dim, block_size, num_seqs = 32, 8, 128, 16, 8
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(600, block_size, kv_heads, dim, generator=gen).half().cuda()
    v_cache = torch.randn(600, block_size, kv_heads, dim, generator=gen).half().cuda()
    tables = torch.zeros(num_seqs, 64, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    slots = torch.zeros(num_seqs, dtype=torch.int64, device="cuda")
    q = torch.zeros(num_seqs, heads, dim, dtype=torch.half, device="cuda")
    k_new = torch.zeros(num_seqs, kv_heads, dim, dtype=torch.half, device="cuda")
    v_new = torch.zeros_like(k_new)
    meta = AttentionMetadata(
        slots, tables, seq_lens, query_start_loc([1] * num_seqs, "cuda"), 1, 64 * block_size
    )

    def step() -> torch.Tensor:
        attn.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
        return attn.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)

    def fill(lengths: list[int]) -> None:  # new inputs, in place; 0 = padding row
        perm = torch.randperm(600, generator=gen)[: num_seqs * 64].view(num_seqs, 64)
        tables.copy_(perm.int())
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        last = [max(n - 1, 0) for n in lengths]
        new_slots = [int(perm[i, p // block_size]) * block_size + p % block_size
                     for i, p in enumerate(last)]  # fmt: skip
        slots.copy_(torch.tensor([s if n else -1 for s, n in zip(new_slots, lengths, strict=True)]))
        for t in (q, k_new, v_new):
            t.copy_(torch.randn(t.shape, generator=gen).half())

    fill([1, 5, 16, 17, 300, 1000, 0, 1023])
    step()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # raises if anything in the step synchronises with the host
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([3, 64, 65, 1, 900, 1024, 0, 2], [1024] * num_seqs):
        fill(lengths)
        graph.replay()
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        expected = attn.reference_decode_attention(q, k_ref, v_ref, tables, seq_lens, dim**-0.5)
        torch.testing.assert_close(out, expected, **TOL[torch.float16])


# ---------------------------------------------------------------------------------------
# cascade (shared_prefix_len > 0) at full size
# ---------------------------------------------------------------------------------------


def check_cascade(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
    prefix_len: int, own: list[int], **kwargs: object,
) -> None:  # fmt: skip
    from tests.test_cascade import shared_prefix_batch

    batch, tables, seq_lens = shared_prefix_batch(
        prefix_len, own, kv_heads, head_dim, block_size, dtype, device="cuda", seed=heads + len(own)
    )
    q = torch.randn(len(own), heads, head_dim, device="cuda").to(dtype)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens, head_dim**-0.5)
    out = attn.paged_decode_attention(*args, shared_prefix_len=prefix_len, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(out, attn.reference_decode_attention(*args), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cascade_full_size(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """64 sequences on a 2,048-token prefix, own lengths 1 .. 270 (the bench's shared case)."""
    own = ragged_lengths(16, 270, 64, seed=heads + head_dim)
    check_cascade(dtype, heads, kv_heads, head_dim, 16, 2048, own, max_seq_len=2048 + 270)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("prefix_pages", [1, 7, 64])
def test_cascade_block_sizes_and_splits(
    block_size: int, num_splits: int | None, prefix_pages: int
) -> None:
    own = ragged_lengths(block_size, 700, 24, seed=block_size)
    check_cascade(torch.bfloat16, 32, 8, 128, block_size, prefix_pages * block_size, own,
                  num_splits=num_splits)  # fmt: skip


@pytest.mark.parametrize("num_seqs", [1, 2, 200])
def test_cascade_one_own_token_and_batch_sizes(num_seqs: int) -> None:
    """seq_len == shared_prefix_len + 1 for every sequence; one, two and many sequences."""
    check_cascade(torch.float16, 9, 3, 64, 16, 1024, [1] * num_seqs)


# the prefix tiles bench/bench_attention.py sweeps: each must compile, fit and be exact
CASCADE_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 32, 4, 3)]


@pytest.mark.parametrize(("block_m", "block_n", "num_warps", "num_stages"), CASCADE_TILES)
@pytest.mark.parametrize("prefix_splits", [None, 2, 16])
def test_cascade_swept_tiles(
    block_m: int, block_n: int, num_warps: int, num_stages: int, prefix_splits: int | None
) -> None:
    from tests.test_cascade import shared_prefix_batch
    from triton_kernels import paged_cascade, paged_decode

    own = ragged_lengths(16, 270, 64, seed=block_m + block_n)
    batch, tables, seq_lens = shared_prefix_batch(2048, own, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(64, 32, 128, device="cuda").to(torch.bfloat16)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens)
    expected = attn.reference_decode_attention(*args, 128**-0.5)
    cfg = paged_cascade.CascadeConfig(block_m, block_n, num_warps, num_stages, prefix_splits)
    for own_splits, own_cfg in ((None, None), (1, paged_decode.DecodeConfig(64, 2, 3))):
        out = torch.full_like(q, float("nan"))
        paged_cascade.launch(*args, out, 128**-0.5, 2048, own_splits, cfg, own_cfg,
                             max_seq_len=2048 + 270)  # fmt: skip
        torch.testing.assert_close(out, expected, **TOL[q.dtype])


def test_cascade_step_has_no_host_sync_and_replays_in_a_cuda_graph() -> None:
    """Capture a cascade decode step (prefix of 32 pages) and replay it over new tables,
    lengths and queries, a padding row (seq_len 0) included."""
    heads, kv_heads, dim, block_size, num_seqs, prefix_pages = 32, 8, 128, 16, 8, 32
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(700, block_size, kv_heads, dim, generator=gen).bfloat16().cuda()
    v_cache = torch.randn(700, block_size, kv_heads, dim, generator=gen).bfloat16().cuda()
    tables = torch.zeros(num_seqs, 64, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device="cuda")
    q = torch.zeros(num_seqs, heads, dim, dtype=torch.bfloat16, device="cuda")
    prefix = prefix_pages * block_size
    meta = AttentionMetadata(
        torch.zeros(num_seqs, dtype=torch.int64, device="cuda"), tables, seq_lens,
        query_start_loc([1] * num_seqs, "cuda"), 1, 64 * block_size, shared_prefix_len=prefix,
    )  # fmt: skip

    def step() -> torch.Tensor:
        return attn.paged_attention(q, k_cache, v_cache, meta, dim**-0.5)

    def fill(own: list[int]) -> None:  # new inputs, in place; -1 = padding row
        perm = torch.randperm(700, generator=gen)[: prefix_pages + num_seqs * 32]
        rows = torch.cat([perm[:prefix_pages].expand(num_seqs, -1),
                          perm[prefix_pages:].view(num_seqs, 32)], 1)  # fmt: skip
        tables.copy_(rows.int())
        seq_lens.copy_(torch.tensor([prefix + n if n >= 0 else 0 for n in own], dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).bfloat16())

    fill([1, 5, 16, 17, 300, 500, -1, 511])
    step()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # raises if anything in the step synchronises with the host
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for own in ([3, 64, 65, 1, 200, 511, -1, 2], [511] * num_seqs):
        fill(own)
        graph.replay()
        expected = attn.reference_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5)
        torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
