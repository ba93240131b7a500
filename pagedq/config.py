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


CACHE_MODES = ("paged", "static")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What `LLM(...)` / `Engine(...)` was asked for, validated; `None` means "derive it"."""

    model: str | None = None  # HF folder; None: the embedded default model
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's fp16/bf16 (else bf16) on CUDA
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    cache: str = "paged"  # "paged" (blocks on demand, prefix sharing) | "static" (preallocated)
    enable_prefix_caching: bool = True  # share full prompt blocks by hash (paged mode only)
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV pool size; None: from the memory budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the card the engine may fill
    kv_cache_bytes: int | None = None  # CPU: byte budget of the KV pool (default 1 GiB)
    max_model_len: int | None = None  # None: min(model maximum, pool tokens)
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int | None = None  # tokens per step; None: 8192 (>= max_model_len)
    enable_chunked_prefill: bool = True  # split long prompts across steps
    seed: int = 0  # seed of the global RNG (unseeded requests)
    enforce_eager: bool = False  # CUDA: never replay decode steps from CUDA graphs
    # launch each step before the host reads the previous one's tokens, so that the GPU never
    # waits for the host (see pagedq/engine/llm_engine.py); None: on for CUDA, off on CPU
    launch_ahead: bool | None = None

    def __post_init__(self) -> None:
        from pagedq.errors import ConfigError

        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(
                f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.launch_ahead is not None and not isinstance(self.launch_ahead, bool):
            raise ConfigError(
                f"launch_ahead must be true, false or None, got {self.launch_ahead!r}"
            )
        _positive("num_blocks", self.num_blocks)
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        _positive("max_model_len", self.max_model_len)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )


def _positive(name: str, value: int | None) -> None:
    from pagedq.errors import ConfigError

    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
