"""Calibration tokens for the quantizer: the bundled text (`pagedq/data/calibration.txt`, written
for the project) or a user's, cut into seeded windows of consecutive tokens.
"""

from __future__ import annotations

import os
from importlib import resources

import torch

from pagedq.errors import ConfigError


def bundled_calibration_text() -> str:
    """The calibration text shipped with pagedq (`pagedq/data/calibration.txt`)."""
    return resources.files("pagedq").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def calibration_windows(
    model_dir: str | os.PathLike[str], text: str | None, samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """`samples` windows [samples, seq_len] int64 of `text` (None: the bundled text)."""
    from pagedq.loader.tokenizer import Tokenizer

    text = bundled_calibration_text() if text is None else text
    ids = Tokenizer.from_model_dir(model_dir).encode(text, add_special_tokens=False)
    return sample_windows(ids, samples, seq_len, seed)


def sample_windows(ids: list[int], samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` windows of `seq_len` consecutive tokens at seeded random offsets."""
    if len(ids) < seq_len:
        raise ConfigError(
            f"the calibration text has {len(ids)} tokens, fewer than seq_len={seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (samples,), generator=gen)
    tokens = torch.tensor(ids, dtype=torch.int64)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    """Raise ConfigError unless `tokens` is a non-empty [samples, seq_len] int64 tensor of ids below
    `vocab_size`."""
    if tokens.dim() != 2 or tokens.dtype != torch.int64 or tokens.numel() == 0:
        raise ConfigError(
            f"calibration tokens must be a non-empty [samples, seq_len] int64 tensor, "
            f"got {tokens.dtype} {tuple(tokens.shape)}"
        )
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise ConfigError(f"calibration token ids span [{lo}, {hi}], vocab_size is {vocab_size}")
