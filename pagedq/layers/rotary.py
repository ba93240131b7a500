"""Rotary position embedding (half-split layout, as HF Llama), with llama3 / linear scaling.

Cos/sin are computed from the positions of each step rather than read from a table, so any
position up to the model's limit works and nothing depends on the batch shape
(`pagedq.ops.fused.rotary_embedding`: one kernel on the GPU).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedq.config import ModelConfig, RopeScaling
from pagedq.ops.fused import rotary_embedding, rotary_write_kv


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The `head_dim / 2` RoPE frequencies in fp32, after the model's scaling rule."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type in ("default", "dynamic"):
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv, scaling)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


def _llama3_frequencies(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 rule: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of a cos/sin cache lookup."""

    inv_freq: torch.Tensor  # [head_dim / 2] fp32

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (possibly in place: use the returned tensors)."""
        return rotary_embedding(positions, q, k, self.inv_freq)

    def rotate_and_cache(
        self,
        positions: torch.Tensor,  # [T] int
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,  # [T] int, negative: not written
    ) -> torch.Tensor:
        """q rotated; k rotated and written with v into `kv_cache` at `slot_mapping` (one
        kernel on the GPU). Use the returned q."""
        return rotary_write_kv(positions, q, k, v, self.inv_freq, kv_cache, slot_mapping)
