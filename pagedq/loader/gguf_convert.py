"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

Reads the file with the `gguf` package, dequantizes every tensor (`gguf.quants.dequantize`),
renames it to the transformers Llama layout and undoes llama.cpp's row permutation of the
query and key projections, so the folder computes the same function as the original model.
The tokenizer (byte-level BPE) is rebuilt from the vocabulary, merges and token types with the
`tokenizers` library. The folder is written into a temporary directory next to `out_dir` and
renamed into place, so nobody ever sees a half-written folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pagedq.errors import CheckpointError, ModelLoadError, ModelNotFoundError, UnsupportedModelError

_REQUIRED = object()
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# tokenizer.ggml.pre -> whether digits are split one by one before GPT-2 byte-level splitting
# (llama.cpp: "smollm"/"starcoder" use "\p{N}" then the GPT-2 regex; "gpt-2" the regex alone).
_PRE_TOKENIZERS = {"smollm": True, "starcoder": True, "gpt-2": False}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write an HF folder (config, safetensors, tokenizer, generation config) for `gguf_path`.

    `out_dir` must not exist yet. If another process publishes the same folder while this one
    converts, that folder is kept and returned.
    """
    source, out = Path(gguf_path), Path(out_dir)
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file {str(source)!r} does not exist")
    if out.exists():
        raise FileExistsError(f"{str(out)!r} already exists; not overwriting it")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedModelError(f"dtype {dtype} is not supported (float16, bfloat16, float32)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published folder is an ordinary one
    try:
        _write_folder(_GGUF(source), tmp, dtype)
        try:
            os.rename(tmp, out)  # atomic; fails if `out` appeared meanwhile
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _GGUF:
    """Typed access to the metadata and tensors of a GGUF file."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader  # imported here: reading GGUF is rare and the import slow

        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as exc:  # gguf raises ValueError / struct errors on bad files
            raise CheckpointError(f"cannot read GGUF file {str(path)!r}: {exc}") from exc
        self.arch = self.string("general.architecture")
        if self.arch != "llama":
            raise UnsupportedModelError(
                f"{str(path)!r}: GGUF architecture {self.arch!r} is not supported (llama)"
            )

    def value(self, key: str, default: Any = _REQUIRED) -> Any:
        """A scalar metadata value (int, float or bool)."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{str(self.path)!r}: GGUF metadata {key!r} is missing")
            return default
        return field.parts[field.data[0]].tolist()[0]

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return self.value(key, default)
        return bytes(field.parts[field.data[0]]).decode("utf-8")

    def strings(self, key: str) -> list[str]:
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelLoadError(f"{str(self.path)!r}: GGUF metadata {key!r} is missing")
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(self, key: str) -> list[int]:
        field = self.reader.fields.get(key)
        if field is None:
            raise ModelLoadError(f"{str(self.path)!r}: GGUF metadata {key!r} is missing")
        return [int(field.parts[i][0]) for i in field.data]


def _write_folder(gguf: _GGUF, folder: Path, dtype: torch.dtype) -> None:
    config = _model_config(gguf, dtype)
    tensors = _tensors(gguf, config, dtype)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _dump(folder / "config.json", config)
    tokenizer, tokenizer_config = _tokenizer(gguf)
    tokenizer.save(str(folder / "tokenizer.json"))
    _dump(folder / "tokenizer_config.json", tokenizer_config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    _dump(folder / "generation_config.json", generation)


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _model_config(gguf: _GGUF, dtype: torch.dtype) -> dict[str, Any]:
    """config.json in the transformers 4.x layout (which 5.x reads too)."""
    hidden = int(gguf.value("llama.embedding_length"))
    heads = int(gguf.value("llama.attention.head_count"))
    head_dim = int(gguf.value("llama.attention.key_length", hidden // heads))
    rotary = int(gguf.value("llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise UnsupportedModelError(f"GGUF rope over {rotary} of {head_dim} dims is not supported")
    tokens = len(gguf.reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(gguf.value("llama.vocab_size", tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(gguf.value("llama.feed_forward_length")),
        "num_hidden_layers": int(gguf.value("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.value("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(gguf.value("llama.context_length")),
        "rms_norm_eps": float(gguf.value("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(gguf.value("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(gguf),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": gguf.value("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": gguf.value("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": gguf.value("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_scaling(gguf: _GGUF) -> dict[str, Any] | None:
    kind = gguf.string("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf.value("llama.rope.scaling.factor"))}
    raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (none, linear)")


def _tensors(gguf: _GGUF, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized, renamed to the HF layout, q/k rows un-permuted."""
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    for tensor in gguf.reader.tensors:
        name = _hf_name(tensor.name)
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if values.shape != expected:
            raise CheckpointError(
                f"{str(gguf.path)!r}: tensor {tensor.name} dequantizes to {values.shape}, "
                f"its header says {expected}"
            )
        weight = torch.from_numpy(values)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, kv_heads)
        out[name] = weight.to(dtype).contiguous()
    return out


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}.weight"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation.

    llama.cpp stores each head's rows interleaved, (r0, r_{d/2}, r1, r_{d/2+1}, ...), so its
    RoPE rotates adjacent pairs; transformers rotates the two halves of a head. Row `2i + j`
    of a GGUF head is row `j * d/2 + i` of the HF head.
    """
    rows, cols = weight.shape  # [num_heads * head_dim, in_features]
    head_dim = rows // num_heads
    assert head_dim * num_heads == rows and head_dim % 2 == 0, (rows, num_heads)
    by_pair = weight.reshape(num_heads, head_dim // 2, 2, cols)  # [h, i, j, in]
    return by_pair.transpose(1, 2).reshape(rows, cols)  # [h, j, i, in] -> HF order


def _tokenizer(gguf: _GGUF) -> tuple[HFTokenizer, dict[str, Any]]:
    """The byte-level BPE tokenizer of the file, and its tokenizer_config.json."""
    kind = gguf.string("tokenizer.ggml.model")
    pre = gguf.string("tokenizer.ggml.pre", "gpt-2")
    if kind != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
            f"(gpt2 with {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = gguf.strings("tokenizer.ggml.tokens")
    types = gguf.ints("tokenizer.ggml.token_type")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise CheckpointError(f"{str(gguf.path)!r}: vocabulary has repeated tokens or bad types")
    pairs = (m.split(" ", 1) for m in gguf.strings("tokenizer.ggml.merges"))
    merges = [(left, right) for left, right in pairs]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = [pre_tokenizers.Digits(individual_digits=True)] if _PRE_TOKENIZERS[pre] else []
    tk.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    added = _added_tokens(tokens, types)
    tk.add_special_tokens([t for t in added if t.special])
    tk.add_tokens([t for t in added if not t.special])
    return tk, _tokenizer_config(gguf, tokens, added)


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    kinds = {_TOKEN_CONTROL: True, _TOKEN_USER_DEFINED: False}
    return [
        AddedToken(token, normalized=False, special=kinds[kind])
        for token, kind in zip(tokens, types, strict=True)
        if kind in kinds
    ]


def _tokenizer_config(gguf: _GGUF, tokens: list[str], added: list[AddedToken]) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = gguf.value(f"tokenizer.ggml.{key}", None)
        return None if index is None else tokens[int(index)]

    decoder = {
        str(tokens.index(t.content)): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for t in added
    }
    config: dict[str, Any] = {
        "add_bos_token": bool(gguf.value("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf.value("tokenizer.ggml.add_eos_token", False)),
        "added_tokens_decoder": decoder,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.value("llama.context_length")),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = gguf.string("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config
