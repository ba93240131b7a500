"""GPTQ settings and the raw tensors of one quantized linear, as stored on disk.

Settings are looked up in `quantize_config.json`, `quant_config.json`, then
`config.json["quantization_config"]` (gptq-format.md). Parsing lives in
`pagedq.gptq.checkpoint`; this module only holds the types everybody shares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, slots=True)
class DynamicRule:
    """One entry of GPTQModel's `dynamic` settings: modules whose name matches `pattern` (a regex,
    matched from the start of the name) are left unquantized (`skip`, a "-:" key) or quantized
    with `overrides` of the settings. The first matching rule wins."""

    pattern: str
    skip: bool
    overrides: tuple[tuple[str, int | bool | None], ...] = ()  # bits, group_size, sym, desc_act


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    """How the linear layers of a checkpoint were quantized."""

    bits: int  # only 4 is supported; others are rejected at load
    group_size: int | None  # input rows per scale/zero group; None: one group over all K (-1)
    desc_act: bool  # act-order: g_idx is not k // group_size
    sym: bool  # symmetric: every zero is the middle of the range
    checkpoint_format: str  # "gptq" (v1: zeros stored minus one) or "gptq_v2" (stored as is)
    lm_head: bool = False  # lm_head is quantized too
    pack_dtype: str = "int32"  # only int32 is supported
    damp_percent: float = 0.01  # quantization time only, kept for round trips
    true_sequential: bool = True  # quantization time only, kept for round trips
    quantizer: tuple[str, ...] = ()  # meta.quantizer: the "tool:version" entries that wrote it
    dynamic: tuple[DynamicRule, ...] = ()  # per-module exceptions (GPTQModel), in order

    def for_module(self, name: str) -> GPTQConfig | None:
        """The settings of the checkpoint linear `name` after the dynamic rules; None: a rule
        leaves it unquantized."""
        for rule in self.dynamic:
            if re.match(rule.pattern, name):
                if rule.skip:
                    return None
                return replace(self, dynamic=(), **dict(rule.overrides))  # type: ignore[arg-type]
        return self

    @property
    def zero_offset(self) -> int:
        """Added to a stored zero nibble to get the real zero (1 for v1, 0 for v2)."""
        return 1 if self.checkpoint_format == "gptq" else 0

    @property
    def zeros_by_word(self) -> bool:
        """v1 zeros stored as `word - 0x11111111` (GPTQModel >= 0.9), read back by whole-word
        addition: a zero of 0 borrowed from the next nibble. Other v1 writers (AutoGPTQ) packed
        each zero minus one into its nibble, and their kernels read each nibble plus one."""
        if self.checkpoint_format != "gptq":
            return False
        return any(_is_gptqmodel_v2_era(entry) for entry in self.quantizer)


def _is_gptqmodel_v2_era(entry: str) -> bool:
    """`entry` is "gptqmodel:X.Y.Z" with X.Y.Z >= 0.9.0, the first version with the v2 codebase."""
    tool, _, version = entry.partition(":")
    found = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if tool.strip().lower() != "gptqmodel" or found is None:
        return False
    return tuple(int(n or 0) for n in found.groups()) >= (0, 9, 0)


@dataclass(frozen=True, slots=True)
class GPTQTensors:
    """The tensors of one quantized linear (weight W is [N = out, K = in]) as read from disk."""

    qweight: torch.Tensor  # [K/8, N] int32: 8 consecutive input rows of one column per word
    qzeros: torch.Tensor  # [G, N/8] int32: 8 consecutive output columns of one group per word
    scales: torch.Tensor  # [G, N] fp16
    g_idx: torch.Tensor | None  # [K] int32 group of each input row; None: k // group_size
    bias: torch.Tensor | None = None  # [N], optional

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[0]) * 8

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])
