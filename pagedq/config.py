"""Typed, frozen, validated configuration of the model and of the engine.

`ModelConfig` is what pagedq needs of a Hugging Face `config.json`, whatever transformers
version wrote it; the loader builds it (`pagedq.loader.hf_config`). Nothing mutates a
config after it is built: derived values go into new objects.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_scaling` in transformers 4.x, `rope_parameters` in 5.x)."""

    rope_type: str  # "linear" | "dynamic" (treated as default at inference) | "llama3"
    factor: float  # frequency divisor (linear, llama3)
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, as read from `config.json`."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int  # rows of the embedding and of lm_head
    hidden_size: int  # model width
    intermediate_size: int  # MLP width
    num_hidden_layers: int  # decoder layers
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads (GQA when fewer than query heads)
    head_dim: int  # per-head width; explicit in config.json or hidden_size // heads
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int  # longest context the model was trained for
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    dtype: str | None  # weight dtype on disk ("float16", "bfloat16", "float32") if stated
    bos_token_id: int | None  # None when the config names none
    eos_token_ids: tuple[int, ...]  # every id that ends generation; may be empty
    attention_bias: bool = False  # q/k/v/o projections carry a bias
    mlp_bias: bool = False  # gate/up/down projections carry a bias

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads
