"""W4b bench set-up: the decode and prefill cases, the swept configs, and paged K/V pools.

Used by bench/bench_attention.py (see there for the conditions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PAGE, HEAD_DIM, DTYPE, DEVICE = 16, 128, torch.bfloat16, "cuda"


@dataclass(frozen=True)
class DecodeCase:
    name: str
    batch: int
    mean_own: int  # mean of each sequence's own tokens
    kv_heads: int = 8
    heads: int = 32
    shared: int = 0  # shared prefix tokens (a multiple of PAGE)
    flashinfer_ref_us: float | None = None  # targets.md, measured 2026-11-29
    target_us: float | None = None


DECODE_CASES = [
    DecodeCase("B=64 mean 2191", 64, 2191, flashinfer_ref_us=168.7, target_us=160),
    DecodeCase("B=64 mean 559", 64, 559, flashinfer_ref_us=58.9, target_us=55),
    DecodeCase("B=256 mean 1001", 256, 1001, flashinfer_ref_us=273.1, target_us=270),
    DecodeCase("B=64 shared 2048+135", 64, 135, shared=2048, flashinfer_ref_us=84.8, target_us=80),
    DecodeCase("MHA 32/32 B=64 mean 1001", 64, 1001, kv_heads=32),
    DecodeCase("B=8 mean 2048", 8, 2048),  # small batch: many splits
]
DECODE_CONFIGS = [  # (block_n, num_warps, num_stages); the first is the default
    (128, 4, 3), (128, 4, 2), (64, 2, 3), (64, 4, 3), (128, 8, 3), (64, 2, 2),
]  # fmt: skip
DECODE_SPLITS = [1, 2, 3, 4, 6, 8, 16]
CASCADE_CONFIGS = [  # prefix kernel (block_m, block_n, num_warps, num_stages); first: default
    (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 32, 4, 3),
]  # fmt: skip
CASCADE_PREFIX_SPLITS = [None, 2, 4, 8, 16]  # None: about one wave of prefix programs
CASCADE_OWN = [  # own-part decode (tiles, split count) with the default prefix config
    (None, 1), (None, 2), ((64, 2, 3), None), ((64, 2, 3), 1), ((64, 4, 3), 1),
]  # fmt: skip


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seqs: int
    new: int  # new tokens per sequence
    cached: int = 0  # cached prefix tokens per sequence
    kv_heads: int = 8
    heads: int = 32


PREFILL_CASES = [
    PrefillCase("4 x 2048 new", 4, 2048),
    PrefillCase("16 x 512 new", 16, 512),
    PrefillCase("8 x 1024 new", 8, 1024),  # where m64/n32 hands over to m128/n64
    PrefillCase("8 x (1536 cached + 512 new)", 8, 512, cached=1536),
]
PREFILL_CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3),
    (128, 64, 4, 4), (64, 32, 4, 4), (64, 32, 2, 3),
]  # fmt: skip

Timing = float | str  # microseconds, or why it could not be measured
# q, k_cache, v_cache, block_tables, seq_lens: the paged decode op's leading arguments
DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def sample_lengths(n: int, mean: int, gen: torch.Generator) -> list[int]:
    lo, hi = max(mean // 2, 1), max(3 * mean // 2, 1)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen)
    diff = mean * n - int(lens.sum())
    for i in torch.randperm(n, generator=gen).tolist():  # nudge to the exact mean
        step = max(min(diff, hi - int(lens[i])), lo - int(lens[i]))
        lens[i] += step
        diff -= step
    return lens.tolist()


@dataclass
class PagedPool:
    k_cache: torch.Tensor  # [num_blocks, PAGE, kv_heads, HEAD_DIM]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    lens: list[int]
    pages: list[list[int]]  # each sequence's page ids


def build_pool(lens_own: list[int], shared: int, kv_heads: int, gen: torch.Generator) -> PagedPool:
    own_pages = [math.ceil(n / PAGE) for n in lens_own]
    num_blocks = shared // PAGE + sum(own_pages) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    prefix, rest = perm[: shared // PAGE], perm[shared // PAGE :]
    starts = [sum(own_pages[:i]) for i in range(len(own_pages))]
    pages = [prefix + rest[a : a + n] for a, n in zip(starts, own_pages, strict=True)]
    tables = torch.zeros(len(lens_own), max(len(p) for p in pages), dtype=torch.int32)
    for i, p in enumerate(pages):
        tables[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    shape = (num_blocks, PAGE, kv_heads, HEAD_DIM)
    lens = [shared + n for n in lens_own]
    k, v = (torch.randn(shape, dtype=DTYPE, device=DEVICE) for _ in range(2))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return PagedPool(k, v, tables.to(DEVICE), seq_lens, lens, pages)


def contiguous_kv(pool: PagedPool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, kv_heads, Lmax, D] copies of the paged K/V and a [B, 1, 1, Lmax] key mask."""
    max_len = max(pool.lens)
    pages = pool.block_tables[:, : math.ceil(max_len / PAGE)].long()
    k = pool.k_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    v = pool.v_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    mask = torch.arange(max_len, device=DEVICE)[None, :] < pool.seq_lens[:, None]
    return k, v, mask[:, None, None, :]
