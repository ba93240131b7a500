"""Perplexity of a model folder (dense or GPTQ) on a text, with pagedq's own model and kernels.

The text is tokenized once (with the tokenizer's special tokens, e.g. a leading BOS) and scored
in windows of `window` tokens that start every `stride` tokens. A window scores the tokens past
the end of the previous window, with the tokens before them in the window as context; a
window's own first token has no context and is never scored (`stride == window`: disjoint
windows, one unscored token each, as in transformers' perplexity recipe; smaller strides:
more context per token, more compute).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedq.errors import ConfigError

if TYPE_CHECKING:
    from pagedq.models.llama import LlamaForCausalLM


def perplexity(
    model_dir: str | os.PathLike[str],
    text: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    window: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
) -> float:
    """exp(mean negative log-likelihood) of the first `max_tokens` tokens of `text`."""
    from pagedq.loader.tokenizer import Tokenizer
    from pagedq.models.llama import load_llama

    if max_tokens is not None and max_tokens < 2:
        raise ConfigError(f"max_tokens={max_tokens} must be at least 2")
    ids = Tokenizer.from_model_dir(model_dir).encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    model = load_llama(model_dir, dtype, device)
    return token_perplexity(model, ids, window=window, stride=stride)


def token_perplexity(
    model: LlamaForCausalLM,
    ids: Sequence[int],
    *,
    window: int = 512,
    stride: int | None = None,
) -> float:
    """Perplexity of the token ids `ids` under `model` (see the module docstring)."""
    stride = window if stride is None else stride
    if window < 2:
        raise ConfigError(f"window={window} must be at least 2 tokens")
    if not 1 <= stride <= window:
        raise ConfigError(f"stride={stride} must lie in [1, window={window}]")
    if len(ids) < 2:
        raise ConfigError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        first = max(prev_end, begin + 1)  # first position whose token this window scores
        if first < end:
            nll += _window_nll(model, ids[begin:end], first - begin)
            scored += end - first
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / scored)


def _window_nll(model: LlamaForCausalLM, chunk: Sequence[int], first: int) -> float:
    """Summed NLL of `chunk[first:]`, each token predicted from the tokens before it."""
    from pagedq.models.llama import contiguous_positions, contiguous_prefill

    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    n = len(chunk)
    ids = torch.tensor(list(chunk), dtype=torch.int64, device=device)  # [T]
    meta, kv_caches = contiguous_prefill([n], model.config, dtype, device)
    with torch.no_grad():
        hidden = model(ids, contiguous_positions([n], device), kv_caches, meta)  # [T, H]
        logits = model.compute_logits(hidden[first - 1 : n - 1])  # [n - first, V] fp32
    return float(F.cross_entropy(logits, ids[first:], reduction="sum"))


def bundled_eval_text() -> str:
    """The held-out evaluation text shipped with pagedq (`pagedq/data/eval.txt`)."""
    return resources.files("pagedq").joinpath("data/eval.txt").read_text(encoding="utf-8")
