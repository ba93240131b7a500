"""Cascade (shared-prefix) decode on CPU: the interpreted kernels vs the reference over block
tables whose rows start with the same pages, its plan, argument checks, the engine's
shared-prefix detection, and greedy tokens of the engine with and without the cascade.

Batches come from tests/test_attention.make_batch: scattered pages, NaN in every slot no
sequence owns, kernel scratch from torch.empty pre-filled with NaN (`poison_empty`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedq.engine import model_runner
from pagedq.ops import attention as attn
from tests.test_attention import TOL, PagedBatch, backend, make_batch, poison_empty

__all__ = ["backend", "poison_empty"]  # fixtures used by name below


def shared_prefix_batch(
    prefix_len: int,
    own_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """Pages of a prefix and of each sequence's own tokens, scattered over one pool; every
    table row starts with the prefix pages. Returns the batch, the tables [num_seqs,
    prefix pages + own pages + 1] int32 and the lengths prefix_len + own [num_seqs] int32."""
    assert prefix_len % block_size == 0
    prefix_pages = prefix_len // block_size
    batch = make_batch([prefix_len, *own_lens], num_kv_heads, head_dim, block_size, dtype,
                       device=device, seed=seed)  # fmt: skip
    own_pages = max([-(-n // block_size) for n in own_lens] + [1])
    tables = torch.zeros(len(own_lens), prefix_pages + own_pages + 1, dtype=torch.int32)
    tables[:, :prefix_pages] = batch.block_tables[0, :prefix_pages].cpu()
    tables[:, prefix_pages : prefix_pages + own_pages] = batch.block_tables[1:, :own_pages].cpu()
    seq_lens = torch.tensor([prefix_len + n for n in own_lens], dtype=torch.int32)
    return batch, tables.to(device), seq_lens.to(device)


def run_cascade(
    prefix_len: int, own_lens: list[int], group: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(cascade output through the public op, reference output)."""
    batch, tables, seq_lens = shared_prefix_batch(
        prefix_len, own_lens, num_kv_heads, head_dim, block_size, dtype, seed=group + head_dim
    )
    q = torch.randn(len(own_lens), group * num_kv_heads, head_dim).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens, head_dim**-0.5)
    out = attn.paged_decode_attention(*args, shared_prefix_len=prefix_len, **kwargs)  # type: ignore[arg-type]
    return out, attn.reference_decode_attention(*args)


# ---------------------------------------------------------------------------------------
# kernels (interpreted) vs the reference
# ---------------------------------------------------------------------------------------

RAGGED = [1, 15, 16, 17, 40, 3]  # own tokens: 1, page edges, several pages

# (group, kv heads, head_dim, block_size, dtype, prefix pages, own lengths, num_splits)
CASES = [
    (4, 2, 64, 16, torch.float32, 1, RAGGED, None),  # one prefix page
    (4, 2, 128, 16, torch.float16, 9, RAGGED, 2),  # several prefix tiles, own split-K
    (3, 3, 64, 16, torch.float16, 5, RAGGED, 1),  # SmolLM2's 9/3 heads
    (3, 1, 128, 32, torch.float32, 4, RAGGED, 3),
    (1, 2, 64, 32, torch.float16, 3, [1, 1, 1], None),  # whole context minus 1 token
    (4, 1, 64, 16, torch.float32, 6, [33], 2),  # one sequence
]


@pytest.mark.parametrize(
    ("group", "kv_heads", "head_dim", "block_size", "dtype", "pages", "own", "splits"), CASES
)
def test_cascade_matches_reference(
    backend, poison_empty, one_thread, group: int, kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, pages: int, own: list[int], splits: int | None,
) -> None:  # fmt: skip
    backend("triton")
    out, expected = run_cascade(
        pages * block_size, own, group, kv_heads, head_dim, block_size, dtype, num_splits=splits
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize(
    ("block_m", "block_n", "prefix_splits"), [(16, 16, 4), (32, 32, 2), (64, 16, None)]
)
def test_cascade_tiles_and_prefix_splits(
    poison_empty, one_thread, block_m: int, block_n: int, prefix_splits: int | None
) -> None:
    """Row tiles that cut through a sequence's group, prefix splits ending mid-tile."""
    from triton_kernels import paged_cascade

    # 7 sequences x group 3 = 21 rows; prefix of 7 pages = 112 keys
    batch, tables, seq_lens = shared_prefix_batch(112, [1, 9, 16, 31, 2, 17, 5], 2, 32, 16,
                                                  torch.float32, seed=3)  # fmt: skip
    q = torch.randn(7, 6, 32)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens)
    cfg = paged_cascade.CascadeConfig(block_m, block_n, prefix_splits=prefix_splits)
    out = torch.full_like(q, float("nan"))
    plan = paged_cascade.launch(*args, out, 0.3, 112, 2, cfg)
    if prefix_splits:
        assert plan.prefix_splits == min(prefix_splits, -(-112 // block_n))
    assert plan.prefix_grid[0] == -(-21 // min(block_m, 32))
    torch.testing.assert_close(out, attn.reference_decode_attention(*args, 0.3), **TOL[q.dtype])


def test_cascade_padding_row_gives_zeros(backend, poison_empty, one_thread) -> None:
    """A captured batch's padding row (seq_len 0) sees no prefix key and no own key."""
    backend("triton")
    batch, tables, seq_lens = shared_prefix_batch(64, [5, 20, 1], 1, 32, 16, torch.float32)
    seq_lens[1] = 0
    q = torch.randn(3, 2, 32)
    args = (q, batch.k_cache, batch.v_cache, tables, seq_lens, 0.2)
    out = attn.paged_decode_attention(*args, shared_prefix_len=64, num_splits=2)
    assert torch.equal(out[1], torch.zeros(2, 32))
    keep = [0, 2]
    expected = attn.reference_decode_attention(*args)[keep]
    torch.testing.assert_close(out[keep], expected, **TOL[q.dtype])


def test_prefix_zero_takes_the_plain_path(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend("triton")
    loaded: list[str] = []
    real = attn._triton_kernels

    def spy(name: str, device: torch.device):
        loaded.append(name)
        return real(name, device)

    monkeypatch.setattr(attn, "_triton_kernels", spy)
    batch, tables, seq_lens = shared_prefix_batch(32, [3, 4], 1, 16, 16, torch.float32)
    args = (torch.randn(2, 1, 16), batch.k_cache, batch.v_cache, tables, seq_lens, 0.5)
    plain = attn.paged_decode_attention(*args)
    assert torch.equal(attn.paged_decode_attention(*args, shared_prefix_len=0), plain)
    attn.paged_decode_attention(*args, shared_prefix_len=32)
    assert loaded == ["paged_decode", "paged_decode", "paged_cascade"]


def test_reference_backend_ignores_the_prefix(backend) -> None:
    backend("torch")
    batch, tables, seq_lens = shared_prefix_batch(48, [3, 30], 1, 16, 16, torch.float32)
    args = (torch.randn(2, 2, 16), batch.k_cache, batch.v_cache, tables, seq_lens, 0.5)
    expected = attn.paged_decode_attention(*args)
    assert torch.equal(attn.paged_decode_attention(*args, shared_prefix_len=48), expected)


# ---------------------------------------------------------------------------------------
# plan and argument checks
# ---------------------------------------------------------------------------------------


def test_plan_for_the_w4b_shared_case() -> None:
    """B=64, 32/8 heads, 2,048-token prefix, own lengths up to 202, 132 SMs: the prefix grid
    fills about one wave, every prefix split is non-empty, partial rows prefix-first."""
    from triton_kernels.paged_cascade import cascade_plan

    plan = cascade_plan(64, 32, 8, 128, 16, torch.bfloat16, 2048, 256, None, None, None, 132)
    tiles, heads, splits = plan.prefix_grid
    assert (tiles, heads) == (4, 8)  # 256 rows of 64 per kv head
    assert 0.9 * 132 <= tiles * heads * splits <= 2 * 132
    assert (splits - 1) * plan.prefix_chunk < 2048 <= splits * plan.prefix_chunk
    assert plan.num_splits == splits + plan.own_splits
    assert plan.own_grid == (64, 8, plan.own_splits)
    assert plan.own_constants["SPLIT"] is True  # own partials always go through the reduce
    again = cascade_plan(64, 32, 8, 128, 16, torch.bfloat16, 2048, 256, None, None, None, 132)
    assert again is plan  # cached per shape


def test_prefix_split_choice() -> None:
    from triton_kernels.paged_cascade import MAX_PREFIX_SPLITS, choose_prefix_splits

    assert choose_prefix_splits(32, 32, 132) == 8  # the W4b shared case: ~2 waves
    assert choose_prefix_splits(16, 32, 132) == 16
    assert choose_prefix_splits(32, 2, 132) == 2  # never more splits than key tiles
    assert choose_prefix_splits(1, 1000, 132) == MAX_PREFIX_SPLITS
    assert choose_prefix_splits(500, 32, 132) == 1
    assert choose_prefix_splits(8, 32, 1) == 1  # the interpreter: one SM


def _args(prefix_len: int = 32) -> dict[str, object]:
    batch, tables, seq_lens = shared_prefix_batch(prefix_len, [3, 4], 1, 16, 16, torch.float32)
    return {
        "q": torch.randn(2, 1, 16), "k_cache": batch.k_cache, "v_cache": batch.v_cache,
        "block_tables": tables, "seq_lens": seq_lens, "scale": 1.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shared_prefix_len": 8}, "multiple of the block size 16, got 8"),
        ({"shared_prefix_len": -16}, "multiple of the block size 16, got -16"),
        ({"shared_prefix_len": 64}, r"shared_prefix_len 64 leaves no own token .* 4 blocks"),
        ({"shared_prefix_len": 32, "max_seq_len": 32}, "max_seq_len is 32"),
    ],
)
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_shared_prefix_argument_checks(backend, name: str, changes: dict, message: str) -> None:
    backend(name)
    with pytest.raises(ValueError, match=message):
        attn.paged_decode_attention(**_args(), **changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# engine: shared-prefix detection and greedy tokens with and without the cascade
# ---------------------------------------------------------------------------------------


def test_shared_prefix_len_of_block_tables() -> None:
    find = model_runner.shared_prefix_len
    rows = [[7, 3, 9, 4, 8, 1, 2], [7, 3, 9, 4, 8, 5, 0], [7, 3, 9, 4, 8, 6, 0]]
    assert find(rows, [100, 90, 81], 16) == 5 * 16
    assert find(rows, [100, 90, 80], 16) == 4 * 16  # 80 tokens: at most 4 shared blocks
    assert find(rows, [100, 90, 64], 16) == 0  # 3 blocks: under CASCADE_MIN_BLOCKS
    assert find(rows[:1], [100], 16) == 0  # one sequence
    assert find([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], [80, 80], 16) == 64  # own token kept
    assert find([[1, 2, 3, 4, 5], [2, 2, 3, 4, 5]], [80, 80], 16) == 0  # first block differs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny"), num_heads=6, num_kv_heads=2, hidden_size=48
    )


def test_engine_cascade_gives_the_same_greedy_tokens(
    tiny: Path, backend, monkeypatch: pytest.MonkeyPatch, one_thread
) -> None:
    """Triton kernels (interpreted) in the engine: a 70-token shared prompt prefix makes
    decode steps cascade over 4 shared pages; the tokens equal those without the cascade."""
    from pagedq import LLM, SamplingParams

    backend("triton")
    seen: list[int] = []
    decode = attn.paged_decode_attention

    def spy(*args: object, shared_prefix_len: int = 0, **kwargs: object) -> torch.Tensor:
        seen.append(shared_prefix_len)
        return decode(*args, shared_prefix_len=shared_prefix_len, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attn, "paged_decode_attention", spy)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 384, (70,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 384, (1 + 3 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = []
    for min_blocks in (4, 10**9):  # cascade on, then off
        monkeypatch.setattr(model_runner, "CASCADE_MIN_BLOCKS", min_blocks)
        seen.clear()
        llm = LLM(str(tiny), device="cpu", num_blocks=64, dtype="float32")
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        assert (max(seen) == 64) if min_blocks == 4 else (set(seen) == {0})
    assert results[0] == results[1]
