"""The on-disk GPTQ 4-bit format: nibble packing and dequantization (see gptq-format.md).

Element j (0..7) of an int32 word sits in bits 4j..4j+3, lowest first. `qweight` packs 8
consecutive input rows of one column per word (`[K/8, N]`); `qzeros` packs 8 consecutive
output columns of one group per word (`[G, N/8]`). Right shifts of int32 are arithmetic, so
every unpack masks after shifting.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]: bit offset of each nibble


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack `q` [K, N] of values 0..15 into int32 `[K/8, N]` (the `qweight` layout)."""
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"rows to pack must be a multiple of {PACK}, got {k}")
    q = q.to(torch.int64).reshape(k // PACK, PACK, n)
    words = (q << _SHIFTS.to(torch.int64).view(1, PACK, 1)).sum(dim=1)
    return _to_int32(words)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 `[K/8, N]` -> int32 `[K, N]` of values 0..15."""
    kw, n = words.shape
    vals = (words.unsqueeze(1) >> _SHIFTS.to(words.device).view(1, PACK, 1)) & 0xF
    return vals.reshape(kw * PACK, n)


def pack_cols(z: torch.Tensor) -> torch.Tensor:
    """Pack `z` [G, N] of values 0..15 into int32 `[G, N/8]` (the `qzeros` layout)."""
    g, n = z.shape
    if n % PACK:
        raise ValueError(f"columns to pack must be a multiple of {PACK}, got {n}")
    z = z.to(torch.int64).reshape(g, n // PACK, PACK)
    words = (z << _SHIFTS.to(torch.int64).view(1, 1, PACK)).sum(dim=2)
    return _to_int32(words)


def unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_cols`: int32 `[G, N/8]` -> int32 `[G, N]` of values 0..15."""
    g, nw = words.shape
    vals = (words.unsqueeze(2) >> _SHIFTS.to(words.device).view(1, 1, PACK)) & 0xF
    return vals.reshape(g, nw * PACK)


def unpack_zeros(qzeros: torch.Tensor, zero_offset: int, by_word: bool = False) -> torch.Tensor:
    """Real zeros `[G, N]` (int32) from `qzeros` `[G, N/8]`: each nibble plus `zero_offset`,
    so a v1 nibble of 15 reads as 16, as AutoGPTQ-era kernels read it. `by_word` (v1 from
    GPTQModel >= 0.9, `GPTQConfig.zeros_by_word`): the nibbles of `word + 0x11111111` modulo
    2^32, the exact inverse of its whole-word subtraction, which lets a zero of 0 borrow."""
    if not by_word:
        return unpack_cols(qzeros) + zero_offset
    words = (qzeros.to(torch.int64) + 0x11111111) & 0xFFFFFFFF
    return unpack_cols(_to_int32(words))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def dequantize(
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [G, N/8] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] int32: group of each input row
    zero_offset: int,  # 1 for v1 ("gptq": zero stored minus one), 0 for v2
    zeros_by_word: bool = False,  # v1 written by GPTQModel >= 0.9 (see unpack_zeros)
) -> torch.Tensor:
    """W^T `[K, N]` in fp32: `scales[g, n] * (q - z)` with `g = g_idx[k]` and z the real zero
    (`unpack_zeros`)."""
    q = unpack_rows(qweight)  # [K, N]
    z = unpack_zeros(qzeros, zero_offset, zeros_by_word)  # [G, N]
    g = g_idx.to(torch.int64)
    return scales.float()[g] * (q - z[g]).float()
