"""Resolve an `EngineConfig` against the machine and the model: device, dtype, KV pool size.

The KV pool is sized once, from `num_blocks`, or from `gpu_memory_utilization` on CUDA, or a
byte budget on CPU; nothing else of that size is allocated later, so a job cannot run out of
memory midway.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedq.config import EngineConfig, ModelConfig
from pagedq.errors import ConfigError, ModelNotFoundError

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_BATCHED_TOKENS = 8192
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """Concrete values the engine runs with."""

    config: EngineConfig
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    num_blocks: int = 0  # set by with_pool
    max_model_len: int = 0  # set by with_pool
    max_num_batched_tokens: int = 0  # set by with_pool

    def with_pool(self, model: ModelConfig) -> ResolvedConfig:
        """Size the KV pool and the length limits once the model is loaded."""
        c = self.config
        per_block = kv_bytes_per_block(model, c.block_size, self.dtype)
        num_blocks = c.num_blocks or self._budget_blocks(model, per_block)
        pool_tokens = num_blocks * c.block_size
        max_len = c.max_model_len or min(model.max_position_embeddings, pool_tokens)
        if max_len > pool_tokens:
            raise ConfigError(
                f"max_model_len={max_len} does not fit the KV pool of {num_blocks} blocks "
                f"x {c.block_size} tokens = {pool_tokens} tokens; lower it or give more memory"
            )
        if c.max_model_len is not None and max_len > model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{model.max_position_embeddings}"
            )
        batched = c.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, c.max_num_seqs)
        if not c.enable_chunked_prefill and batched < max_len:
            raise ConfigError(
                f"max_num_batched_tokens={batched} < max_model_len={max_len} needs chunked prefill"
            )
        return dataclasses.replace(
            self, num_blocks=num_blocks, max_model_len=max_len, max_num_batched_tokens=batched
        )

    def _budget_blocks(self, model: ModelConfig, per_block: int) -> int:
        c = self.config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * c.gpu_memory_utilization) - used - activation_bytes(model, c)
            where = f"gpu_memory_utilization={c.gpu_memory_utilization} of {total / 2**30:.1f} GiB"
        else:
            budget = c.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
            where = f"kv_cache_bytes={budget}"
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"no room for KV blocks ({per_block} bytes each) within {where} after the model"
            )
        return num_blocks


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * elem
    return per_token * block_size


def activation_bytes(model: ModelConfig, c: EngineConfig) -> int:
    """A generous bound on the transient tensors of one step (kept out of the KV budget)."""
    tokens = c.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    width = 4 * model.hidden_size + 3 * model.intermediate_size
    logits = c.max_num_seqs * model.vocab_size * 4 * 4
    return tokens * width * 4 + logits + (512 << 20)


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Pick the model folder, device and dtype (the pool is sized after loading)."""
    device = _device(config.device)
    model_dir = _model_dir(config.model)
    return ResolvedConfig(config, model_dir, device, _dtype(config, model_dir, device))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} was asked for but CUDA is not available")
    return device


def _model_dir(model: str | None) -> Path:
    if model is None:
        from pagedq.gptq.default import default_quantized_model_dir

        return default_quantized_model_dir()
    path = Path(os.path.expanduser(model))
    if not path.is_dir():
        raise ModelNotFoundError(f"model folder {str(path)!r} does not exist")
    return path


def _dtype(config: EngineConfig, model_dir: Path, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if device.type == "cpu":
        return torch.float32
    from pagedq.loader.hf_config import load_model_config

    on_disk = load_model_config(model_dir).dtype
    return torch.float16 if on_disk == "float16" else torch.bfloat16
