"""config.json parsing (transformers 4.x and 5.x layouts) and safetensors checkpoint access."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pagedq.config import RopeScaling
from pagedq.errors import (
    CheckpointError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from pagedq.loader.hf_config import load_model_config
from pagedq.loader.weights import Checkpoint

# --- config.json -------------------------------------------------------------------------

LLAMA2_4X: dict[str, Any] = {  # as transformers 4.x wrote Llama-2-7B
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

LLAMA3_5X: dict[str, Any] = {  # as transformers 5.x writes Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "bos_token_id": 128000,
    "dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

SMOLLM2: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_folder(path: Path, config: dict[str, Any], **files: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return path


def with_changes(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if value is ...:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def test_llama2_4x_layout(tmp_path: Path) -> None:
    cfg = load_model_config(write_folder(tmp_path, LLAMA2_4X))
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 11008, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 32, 128)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.dtype == "float16" and cfg.max_position_embeddings == 4096
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.tie_word_embeddings is False and cfg.rms_norm_eps == 1e-5


def test_llama3_5x_layout_with_llama3_scaling(tmp_path: Path) -> None:
    cfg = load_model_config(write_folder(tmp_path, LLAMA3_5X))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.dtype == "bfloat16" and cfg.num_queries_per_kv == 4
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_llama3_scaling_in_4x_layout(tmp_path: Path) -> None:
    scaling = dict(LLAMA3_5X["rope_parameters"])
    theta = scaling.pop("rope_theta")
    raw = with_changes(LLAMA3_5X, rope_parameters=..., rope_scaling=scaling, rope_theta=theta)
    cfg = load_model_config(write_folder(tmp_path, raw))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({"type": "linear", "factor": 2.0}, RopeScaling("linear", 2.0)),
        ({"rope_type": "dynamic", "factor": 4.0}, RopeScaling("dynamic", 4.0)),
        ({"rope_type": "default"}, None),
        (None, None),
    ],
)
def test_other_rope_scalings(tmp_path: Path, scaling: Any, expected: RopeScaling | None) -> None:
    cfg = load_model_config(write_folder(tmp_path, with_changes(LLAMA2_4X, rope_scaling=scaling)))
    assert cfg.rope_scaling == expected


def test_gqa_9_over_3_and_tied_embeddings(tmp_path: Path) -> None:
    cfg = load_model_config(write_folder(tmp_path, SMOLLM2))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.num_queries_per_kv == 3 and cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0 and cfg.dtype is None


def test_explicit_head_dim_wins(tmp_path: Path) -> None:
    raw = with_changes(SMOLLM2, hidden_size=5120, num_attention_heads=32, num_key_value_heads=8)
    raw["head_dim"] = 128  # Mistral-Nemo style: heads * head_dim != hidden_size
    assert load_model_config(write_folder(tmp_path, raw)).head_dim == 128


def test_missing_kv_heads_means_mha(tmp_path: Path) -> None:
    raw = with_changes(LLAMA2_4X, num_key_value_heads=...)
    assert load_model_config(write_folder(tmp_path, raw)).num_key_value_heads == 32


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path, SMOLLM2, generation_config={"eos_token_id": [2, 0], "bos_token_id": 1}
    )
    assert load_model_config(folder).eos_token_ids == (2, 0)


def test_mistral_without_window_is_fine(tmp_path: Path) -> None:
    raw = with_changes(
        LLAMA2_4X,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=8,
        max_position_embeddings=32768,
        sliding_window=None,
        rope_theta=1000000.0,
    )
    cfg = load_model_config(write_folder(tmp_path, raw))
    assert cfg.architecture == "MistralForCausalLM" and cfg.rope_theta == 1e6


def test_mistral_sliding_window_is_rejected(tmp_path: Path) -> None:
    raw = with_changes(
        LLAMA2_4X,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        max_position_embeddings=32768,
        sliding_window=4096,
    )
    with pytest.raises(UnsupportedModelError, match="sliding_window 4096"):
        load_model_config(write_folder(tmp_path, raw))


def test_llama_ignores_sliding_window_like_transformers(tmp_path: Path) -> None:
    raw = with_changes(LLAMA2_4X, sliding_window=1024)
    assert load_model_config(write_folder(tmp_path, raw)).max_position_embeddings == 4096


def test_transformers_written_config_roundtrips(tmp_path: Path) -> None:
    """Whatever layout the installed transformers writes is read back to the same values."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        rope_theta=50000.0,
        tie_word_embeddings=True,
        eos_token_id=[5, 6],
    )
    hf.save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == (2, 32, True)
    assert cfg.eos_token_ids == (5, 6)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        load_model_config(tmp_path / "nowhere")


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_model_config(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model_config(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    raw = with_changes(LLAMA2_4X, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model_config(write_folder(tmp_path, raw))


@pytest.mark.parametrize("rope_type", ["yarn", "longrope", "su"])
def test_unsupported_rope_type(tmp_path: Path, rope_type: str) -> None:
    raw = with_changes(LLAMA2_4X, rope_scaling={"rope_type": rope_type, "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match=rope_type):
        load_model_config(write_folder(tmp_path, raw))


def test_unsupported_rope_type_in_5x_layout(tmp_path: Path) -> None:
    params = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    raw = with_changes(LLAMA3_5X, rope_parameters=params)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model_config(write_folder(tmp_path, raw))


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"hidden_size": ...}, ModelLoadError, "hidden_size"),
        ({"vocab_size": -3}, ModelLoadError, "vocab_size"),
        ({"num_key_value_heads": 5}, CheckpointError, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
        ({"torch_dtype": "float8_e4m3fn"}, UnsupportedModelError, "float8"),
        ({"eos_token_id": "2"}, ModelLoadError, "eos_token_id"),
        ({"partial_rotary_factor": 0.5}, UnsupportedModelError, "partial_rotary_factor"),
    ],
)
def test_bad_configs(
    tmp_path: Path, changes: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        load_model_config(write_folder(tmp_path, with_changes(LLAMA2_4X, **changes)))


# --- safetensors checkpoints -------------------------------------------------------------


def mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.fp32": torch.randn(3, 5, generator=gen),
        "b.fp16": torch.randn(7, generator=gen).half(),
        "c.bf16": torch.randn(2, 2, 2, generator=gen).bfloat16(),
        "d.int32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


def test_single_file_preserves_dtypes(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    assert ckpt.names() == sorted(tensors)
    for name, tensor in tensors.items():
        assert name in ckpt
        assert ckpt.dtype_of(name) == tensor.dtype
        assert ckpt.shape_of(name) == tuple(tensor.shape)
        got = ckpt.get(name)
        assert got.dtype == tensor.dtype and got.device.type == "cpu"
        assert torch.equal(got, tensor)
    assert "missing" not in ckpt


def write_sharded(folder: Path) -> dict[str, torch.Tensor]:
    tensors = mixed_tensors()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(folder / shard))
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_sharded_with_index(tmp_path: Path) -> None:
    tensors = write_sharded(tmp_path)
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.names() == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(ckpt.get(name), tensor) and ckpt.dtype_of(name) == tensor.dtype


def test_several_files_without_index(tmp_path: Path) -> None:
    tensors = mixed_tensors()
    save_file({"a.fp32": tensors["a.fp32"]}, str(tmp_path / "part1.safetensors"))
    save_file({"b.fp16": tensors["b.fp16"]}, str(tmp_path / "part2.safetensors"))
    assert Checkpoint.open(tmp_path).names() == ["a.fp32", "b.fp16"]


def test_truncated_file(tmp_path: Path) -> None:
    save_file(mixed_tensors(), str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        Checkpoint.open(tmp_path)


def test_bad_header(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        Checkpoint.open(tmp_path)


def test_truncated_shard_fails_when_read(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    ckpt = Checkpoint.open(tmp_path)
    assert torch.equal(ckpt.get("a.fp32"), mixed_tensors()["a.fp32"])  # other shard is fine
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        ckpt.get("c.bf16")


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002"):
        Checkpoint.open(tmp_path)


def test_unknown_tensor_names_tensor_and_folder(tmp_path: Path) -> None:
    save_file(mixed_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight'.*" + tmp_path.name):
        Checkpoint.open(tmp_path).get("lm_head.weight")


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle") as info:
        Checkpoint.open(tmp_path)
    assert not isinstance(info.value, ModelNotFoundError)


def test_folder_without_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        Checkpoint.open(tmp_path)
    with pytest.raises(ModelNotFoundError):
        Checkpoint.open(tmp_path / "absent")
