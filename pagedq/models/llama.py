"""The Llama-family decoder over a paged KV cache.

The forward pass takes a flat batch of tokens from many sequences (prefill chunks and decode
tokens mixed) with explicit `AttentionMetadata`; every attention and linear op goes through
`pagedq.ops` / the linear modules, so kernels plug in without touching this file.

    embed → [RMSNorm → QKV → RoPE → write KV → paged attention → O → RMSNorm → gate/up
            → SiLU·mul → down] × L → norm → lm_head
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedq.config import ModelConfig
from pagedq.errors import CheckpointError, UnsupportedModelError
from pagedq.gptq.config import GPTQConfig
from pagedq.layers.linear import ConcatLinear, DenseLinear
from pagedq.layers.norm import RMSNorm
from pagedq.layers.rotary import RotaryEmbedding
from pagedq.ops.attention import AttentionMetadata, paged_attention
from pagedq.ops.fused import silu_mul
from pagedq.ops.triton_loader import launch_device

if TYPE_CHECKING:
    from pagedq.loader.weights import Checkpoint

KVCache = tuple[
    torch.Tensor, torch.Tensor
]  # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, qkv_proj: nn.Module, o_proj: nn.Module) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = qkv_proj  # [T, hidden] -> [T, (heads + 2 * kv_heads) * head_dim]
        self.o_proj = o_proj  # [T, heads * head_dim] -> [T, hidden]
        self.rotary = RotaryEmbedding(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q = self.rotary.rotate_and_cache(positions, q, k, v, kv_cache, meta.slot_mapping)
        out = paged_attention(q, *kv_cache, meta, self.scale)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj  # [T, hidden] -> [T, 2 * intermediate]: [gate | up]
        self.down_proj = down_proj  # [T, intermediate] -> [T, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        input_layernorm: RMSNorm,
        self_attn: LlamaAttention,
        post_attention_layernorm: RMSNorm,
        mlp: LlamaMLP,
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [T, hidden]: the previous layer's output (or the embeddings)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before it (None: first layer)
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): each add is fused into the
        next norm, so the stream is `residual + output` after the layer."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and lm_head (tied to the embeddings or not)."""

    def __init__(
        self,
        config: ModelConfig,
        embed_tokens: nn.Embedding,
        layers: Sequence[LlamaDecoderLayer],
        norm: RMSNorm,
        lm_head: nn.Module | None,  # None: tied to embed_tokens
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: Sequence[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        with launch_device(input_ids.device):  # a model on cuda:N launches its kernels there
            hidden = self.embed_tokens(input_ids)  # [T, hidden]
            residual: torch.Tensor | None = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
            if residual is None:
                return self.norm(hidden)
            return self.norm.add_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] fp32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        with launch_device(hidden.device):  # a quantized lm_head may launch Triton
            return self.lm_head(hidden).float()


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[KVCache]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


def contiguous_prefill(
    seq_lens: Sequence[int],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = 16,
) -> tuple[AttentionMetadata, list[KVCache]]:
    """Metadata and a throwaway KV cache to run whole sequences from position 0 in one pass.

    For tools that need plain forward passes (quantizer calibration, perplexity): sequence `i`
    gets consecutive blocks; the flat batch is the sequences back to back.
    """
    device = torch.device(device)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots: list[torch.Tensor] = []
    first = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        tables[i, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots.append(torch.arange(first * block_size, first * block_size + n, dtype=torch.int64))
        first += nb
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(list(seq_lens), dtype=torch.int32), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
    )
    return meta, allocate_kv_caches(config, first, block_size, dtype, device)


def contiguous_positions(seq_lens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Positions 0..len-1 of each sequence, back to back: [sum(seq_lens)] int64."""
    return torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens]).to(device)


# --- loading ------------------------------------------------------------------------------


def load_llama(
    model_dir: str | os.PathLike[str], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """Build the model from a Hugging Face folder (dense or GPTQ), weights via safetensors only."""
    from pagedq.gptq.checkpoint import load_gptq_config
    from pagedq.loader.hf_config import load_model_config
    from pagedq.loader.weights import Checkpoint

    config = load_model_config(model_dir)
    builder = _Builder(
        config, Checkpoint.open(model_dir), load_gptq_config(model_dir), dtype, device
    )
    return builder.build()


class _Builder:
    """Reads, checks and places every tensor of the model; fuses q/k/v and gate/up along N."""

    def __init__(
        self,
        config: ModelConfig,
        ckpt: Checkpoint,
        gptq: GPTQConfig | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config, self.ckpt, self.gptq = config, ckpt, gptq
        self.dtype, self.device = dtype, torch.device(device)

    def build(self) -> LlamaForCausalLM:
        c = self.config
        extra = f"model.layers.{c.num_hidden_layers}.input_layernorm.weight"
        if extra in self.ckpt:
            raise CheckpointError(
                "checkpoint has more layers than config.json's "
                f"num_hidden_layers={c.num_hidden_layers}"
            )
        embed = nn.Embedding.from_pretrained(
            self.tensor("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)), freeze=True
        )
        layers = [self.layer(i) for i in range(c.num_hidden_layers)]
        norm = RMSNorm(self.tensor("model.norm.weight", (c.hidden_size,)), c.rms_norm_eps)
        lm_head: nn.Module | None = None
        if (
            not c.tie_word_embeddings
            or "lm_head.weight" in self.ckpt
            or "lm_head.qweight" in self.ckpt
        ):
            lm_head = self.linear(["lm_head"], [c.vocab_size], c.hidden_size, bias=False)
        return LlamaForCausalLM(c, embed, layers, norm, lm_head).to(self.device)

    def layer(self, i: int) -> LlamaDecoderLayer:
        c, p = self.config, f"model.layers.{i}."
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        attn_names = [p + "self_attn." + n for n in ("q_proj", "k_proj", "v_proj")]
        qkv = self.linear(attn_names, [q, kv, kv], c.hidden_size, c.attention_bias)
        o = self.linear([p + "self_attn.o_proj"], [c.hidden_size], q, c.attention_bias)
        gate_up = self.linear(
            [p + "mlp.gate_proj", p + "mlp.up_proj"],
            [c.intermediate_size] * 2,
            c.hidden_size,
            c.mlp_bias,
        )
        down = self.linear([p + "mlp.down_proj"], [c.hidden_size], c.intermediate_size, c.mlp_bias)
        return LlamaDecoderLayer(
            RMSNorm(self.tensor(p + "input_layernorm.weight", (c.hidden_size,)), c.rms_norm_eps),
            LlamaAttention(c, qkv, o),
            RMSNorm(
                self.tensor(p + "post_attention_layernorm.weight", (c.hidden_size,)), c.rms_norm_eps
            ),
            LlamaMLP(gate_up, down),
        )

    def linear(
        self, prefixes: list[str], out_sizes: list[int], in_size: int, bias: bool
    ) -> nn.Module:
        """One module computing the concatenated outputs of `prefixes` (all reading the same x).
        Parts stored quantized (`.qweight`) and dense ones (a GPTQ checkpoint may leave some
        unquantized) each fuse with their neighbours of the same kind."""
        modules: list[nn.Module] = []
        parts = zip(prefixes, out_sizes, strict=True)
        for quantized, run in itertools.groupby(parts, key=lambda part: self.quantized(part[0])):
            names, sizes = map(list, zip(*run, strict=True))
            if quantized:
                modules.append(self.gptq_linear(names, sizes, in_size))
            else:
                modules.append(self.dense_linear(names, sizes, in_size, bias))
        return modules[0] if len(modules) == 1 else ConcatLinear(modules)

    def quantized(self, prefix: str) -> bool:
        return self.gptq is not None and f"{prefix}.qweight" in self.ckpt

    def dense_linear(
        self, prefixes: list[str], out_sizes: list[int], in_size: int, bias: bool
    ) -> DenseLinear:
        weights = [
            self.tensor(f"{p}.weight", (n, in_size))
            for p, n in zip(prefixes, out_sizes, strict=True)
        ]
        biases = None
        if bias:
            biases = torch.cat(
                [self.tensor(f"{p}.bias", (n,)) for p, n in zip(prefixes, out_sizes, strict=True)]
            )
        return DenseLinear(torch.cat(weights), biases)

    def gptq_linear(self, prefixes: list[str], out_sizes: list[int], in_size: int) -> nn.Module:
        from pagedq.gptq.checkpoint import read_gptq_tensors
        from pagedq.gptq.linear import GPTQLinear

        assert self.gptq is not None
        configs = []
        for p in prefixes:  # the settings' dynamic rules may differ per linear
            cfg = self.gptq.for_module(p)
            if cfg is None:
                raise CheckpointError(
                    f"{p}: stored quantized, but a dynamic rule of the GPTQ settings says it is not"
                )
            if cfg.bits != 4:
                raise UnsupportedModelError(
                    f"{p}: bits={cfg.bits} (a dynamic rule of the GPTQ settings) is not "
                    "supported; pagedq runs 4-bit"
                )
            configs.append(cfg)
        parts = [read_gptq_tensors(self.ckpt, p) for p in prefixes]
        for p, part, n in zip(prefixes, parts, out_sizes, strict=True):
            if (part.in_features, part.out_features) != (in_size, n):
                raise CheckpointError(
                    f"{p}: quantized weight is {part.out_features}x{part.in_features} (out x in), "
                    f"config.json implies {n}x{in_size}"
                )
        try:
            return GPTQLinear(parts, configs, self.dtype, self.device)
        except CheckpointError as e:  # its errors count parts: name them
            raise CheckpointError(f"{', '.join(prefixes)}: {e}") from None

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A floating-point tensor checked against the config's shape, cast to the model dtype."""
        if name not in self.ckpt:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        t = self.ckpt.get(name)
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(t.shape)}, config.json implies {shape}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, expected a float dtype")
        return t.to(device=self.device, dtype=self.dtype)
