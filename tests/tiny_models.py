"""Random tiny Llama folders written by transformers, with a small byte-level BPE tokenizer.

Tests use them as independent checkpoints: transformers writes the files, pagedq reads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in "
    "fixed-size blocks. A shared system prompt is computed once and reused by every request. "
    "Numbers 0123456789, punctuation !?;:, and unicode: café, naïve, 東京, emoji 🙂.\n"
) * 4

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json of `vocab_size` ids (3 special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "add_bos_token": False,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_llama(
    folder: Path,
    *,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Save a random LlamaForCausalLM (safetensors) and a tokenizer into `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # larger weights than the default init, so logits are not all ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, vocab_size)
    return folder


def hf_model(folder: Path) -> Any:
    """The folder loaded by transformers, fp32, for reference runs."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step raw log-probs [vocab] from a transformers model."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.logits]  # raw, unprocessed
    return tokens, logprobs
