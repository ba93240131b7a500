"""GPTQ settings lookup and validation, tensor reading, and the save -> load round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedq.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from pagedq.gptq.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    gptq_config_dict,
    load_gptq_config,
    parse_gptq_config,
    read_gptq_tensors,
    save_gptq_model,
)
from pagedq.gptq.config import GPTQConfig, GPTQTensors

BASE = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def write(folder: Path, name: str, data: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(data if isinstance(data, str) else json.dumps(data))


class DictSource:
    """A checkpoint stand-in: the `in` / `get` interface over a dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def random_part(k: int, n: int, gs: int | None, *, bias: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if gs is None else -(-k // gs)
    words = lambda *shape: torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64)
    return GPTQTensors(
        qweight=words(k // 8, n).to(torch.int32),
        qzeros=words(groups, n // 8).to(torch.int32),
        scales=torch.rand(groups, n, generator=gen).to(torch.float16),
        g_idx=torch.randint(0, groups, (k,), generator=gen, dtype=torch.int32),
        bias=torch.randn(n, generator=gen).to(torch.float16) if bias else None,
    )


# --- settings -------------------------------------------------------------------------------


def test_no_quantization_settings_means_dense(tmp_path: Path) -> None:
    write(tmp_path, "config.json", {"model_type": "llama"})
    assert load_gptq_config(tmp_path) is None


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nope"):
        load_gptq_config(tmp_path / "nope")


def test_lookup_order(tmp_path: Path) -> None:
    write(tmp_path, "config.json", {"quantization_config": {**BASE, "quant_method": "gptq"}})
    assert load_gptq_config(tmp_path) == parse_gptq_config(BASE)
    write(tmp_path, "quant_config.json", {**BASE, "group_size": 64})
    assert load_gptq_config(tmp_path).group_size == 64  # type: ignore[union-attr]
    write(tmp_path, "quantize_config.json", {**BASE, "group_size": 32})
    assert load_gptq_config(tmp_path).group_size == 32  # type: ignore[union-attr]


def test_defaults_and_variants() -> None:
    cfg = parse_gptq_config({"bits": 4})
    assert cfg == GPTQConfig(
        bits=4, group_size=None, desc_act=False, sym=True, checkpoint_format="gptq"
    )
    cfg = parse_gptq_config(
        {
            **BASE,
            "group_size": -1,
            "desc_act": True,
            "sym": False,
            "format": "gptq_v2",
            "lm_head": True,
            "pack_dtype": "torch.int32",
            "damp_percent": 0.1,
            "true_sequential": False,
            "static_groups": False,
        }
    )
    assert cfg == GPTQConfig(
        bits=4,
        group_size=None,
        desc_act=True,
        sym=False,
        checkpoint_format="gptq_v2",
        lm_head=True,
        damp_percent=0.1,
        true_sequential=False,
    )
    assert cfg.zero_offset == 0 and parse_gptq_config(BASE).zero_offset == 1
    both = parse_gptq_config({**BASE, "checkpoint_format": "gptq_v2", "format": "gptq"})
    assert both.checkpoint_format == "gptq_v2"  # checkpoint_format wins over format


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        ({**BASE, "bits": 8}, UnsupportedModelError, ["bits=8", "4-bit"]),
        ({**BASE, "bits": 3}, UnsupportedModelError, ["bits=3"]),
        ({**BASE, "pack_dtype": "int16"}, UnsupportedModelError, ["pack_dtype='int16'", "int32"]),
        ({**BASE, "quant_method": "awq"}, UnsupportedModelError, ["'awq'", "gptq"]),
        ({"w_bit": 4, "q_group_size": 128, "zero_point": True}, UnsupportedModelError, ["awq"]),
        ({**BASE, "checkpoint_format": "marlin"}, UnsupportedModelError, ["'marlin'", "gptq_v2"]),
        ({**BASE, "group_size": 0}, UnsupportedModelError, ["group_size=0", "-1"]),
        ({**BASE, "group_size": -2}, UnsupportedModelError, ["group_size=-2"]),
        ({**BASE, "desc_act": "yes"}, CheckpointError, ["desc_act='yes'"]),
        ({"group_size": 128}, CheckpointError, ["bits"]),
        ({**BASE, "meta": "gptqmodel"}, CheckpointError, ["meta='gptqmodel'", "object"]),
        ({**BASE, "meta": {"quantizer": [4]}}, CheckpointError, ["meta.quantizer=[4]", "strings"]),
        ({**BASE, "dynamic": ["-:.*"]}, CheckpointError, ["dynamic=['-:.*']", "object"]),
        ({**BASE, "dynamic": {"-:.*": None}}, CheckpointError, ["'-:.*'", "object"]),
        ({**BASE, "dynamic": {"+:(": {}}}, CheckpointError, ["'+:('", "regular expression"]),
        ({**BASE, "dynamic": {"x": {"bits": "8"}}}, CheckpointError, ["'x'", "bits='8'"]),
        ({**BASE, "dynamic": {"x": {"group_size": 0}}}, UnsupportedModelError, ["group_size=0"]),
    ],
)
def test_rejected_settings(raw: dict[str, Any], error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        parse_gptq_config(raw)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("quantizer", "by_word"),
    [
        (["gptqmodel:7.6.0"], True),
        ("GPTQModel:0.9.0", True),  # one string, any case
        (["gptqmodel:4.0.0-dev"], True),
        (["autogptq:0.7.1", "gptqmodel:1"], True),
        (["gptqmodel:0.8.9"], False),  # before the v2 codebase
        (["gptqmodel:unknown"], False),
        (["pagedq:0.1.0"], False),
        (None, False),
    ],
)
def test_meta_quantizer_decides_how_v1_zeros_read(quantizer: Any, by_word: bool) -> None:
    meta = {"quantizer": quantizer}
    cfg = parse_gptq_config({**BASE, "sym": False, "meta": meta})
    assert cfg.zeros_by_word is by_word
    entries = [quantizer] if isinstance(quantizer, str) else quantizer or []
    assert gptq_config_dict(cfg)["meta"] == {"quantizer": entries}  # kept when written back
    assert parse_gptq_config(gptq_config_dict(cfg)) == cfg
    v2 = parse_gptq_config({**BASE, "checkpoint_format": "gptq_v2", "meta": meta})
    assert not v2.zeros_by_word  # v2 stores zeros as they are


def test_dynamic_rules_per_linear() -> None:
    dynamic = {
        r"-:.*\.layers\.0\.": {},
        r"+:.*down_proj": {"group_size": 32, "sym": False, "adapter": {"rank": 8}},
        r".*up_proj": {"bits": 8, "desc_act": True},
        r".*\.layers\.[0-9]+\.mlp\.": {"group_size": -1},
    }
    cfg = parse_gptq_config({**BASE, "dynamic": dynamic})
    assert cfg.for_module("model.layers.0.mlp.down_proj") is None  # the first match wins
    down = cfg.for_module("model.layers.3.mlp.down_proj")
    assert down is not None and (down.group_size, down.sym, down.bits) == (32, False, 4)
    up = cfg.for_module("model.layers.3.mlp.up_proj")
    assert up is not None and (up.bits, up.desc_act, up.group_size) == (8, True, 128)
    gate = cfg.for_module("model.layers.3.mlp.gate_proj")
    assert gate is not None and gate.group_size is None  # -1: one group
    assert cfg.for_module("model.layers.3.self_attn.q_proj") == cfg  # no rule matches
    assert parse_gptq_config(gptq_config_dict(cfg)) == cfg  # written back, in order


def test_rejected_in_files(tmp_path: Path) -> None:
    write(tmp_path, "config.json", {"quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(UnsupportedModelError, match="awq"):
        load_gptq_config(tmp_path)
    write(tmp_path, "quantize_config.json", "{not json")
    with pytest.raises(CheckpointError, match="quantize_config"):
        load_gptq_config(tmp_path)


def test_settings_dict_round_trip() -> None:
    for cfg in (
        parse_gptq_config(BASE),
        parse_gptq_config({**BASE, "group_size": -1, "desc_act": True, "sym": False}),
    ):
        written = gptq_config_dict(cfg)
        assert written["quant_method"] == "gptq" and written["static_groups"] is False
        assert parse_gptq_config(written) == cfg


# --- reading tensors ------------------------------------------------------------------------


def source_of(prefix: str, part: GPTQTensors) -> dict[str, torch.Tensor]:
    tensors = {f"{prefix}.qweight": part.qweight, f"{prefix}.qzeros": part.qzeros}
    tensors[f"{prefix}.scales"] = part.scales
    if part.g_idx is not None:
        tensors[f"{prefix}.g_idx"] = part.g_idx
    if part.bias is not None:
        tensors[f"{prefix}.bias"] = part.bias
    return tensors


def test_read_tensors() -> None:
    part = random_part(128, 64, 32, bias=True)
    got = read_gptq_tensors(DictSource(source_of("m.q_proj", part)), "m.q_proj")
    assert got.in_features == 128 and got.out_features == 64
    for a, b in zip(
        (got.qweight, got.qzeros, got.scales, got.g_idx, got.bias),
        (part.qweight, part.qzeros, part.scales, part.g_idx, part.bias),
        strict=True,
    ):
        assert a is not None and b is not None and torch.equal(a, b)
    tensors = source_of("m.q_proj", part)
    del tensors["m.q_proj.g_idx"], tensors["m.q_proj.bias"]
    got = read_gptq_tensors(DictSource(tensors), "m.q_proj")
    assert got.g_idx is None and got.bias is None


@pytest.mark.parametrize("missing", ["qweight", "qzeros", "scales"])
def test_read_missing_tensor(missing: str) -> None:
    tensors = source_of("m.o_proj", random_part(64, 32, 32))
    del tensors[f"m.o_proj.{missing}"]
    with pytest.raises(CheckpointError, match=f"m.o_proj.{missing}"):
        read_gptq_tensors(DictSource(tensors), "m.o_proj")


@pytest.mark.parametrize(
    ("part", "value", "words"),
    [
        ("qweight", lambda t: t.float(), ["qweight", "float32"]),
        ("qweight", lambda t: t.long(), ["int32", "int64"]),
        ("qzeros", lambda t: t.to(torch.int16), ["int32", "int16"]),
        ("scales", lambda t: t.to(torch.int32), ["scales", "int32"]),
        ("g_idx", lambda t: t.float(), ["g_idx", "float32"]),
        ("bias", lambda t: t.to(torch.int32), ["bias", "int32"]),
        ("scales", lambda t: t[:1], ["scales", "shape"]),
        ("qzeros", lambda t: t[:, :2], ["qzeros", "shape"]),
        ("g_idx", lambda t: t[:8], ["g_idx", "shape"]),
        ("g_idx", lambda t: t + 5, ["g_idx", "[0, 2)"]),
        ("bias", lambda t: t[:8], ["bias", "shape"]),
    ],
)
def test_read_bad_tensor(part: str, value: Any, words: list[str]) -> None:
    tensors = source_of("m.x", random_part(64, 32, 32, bias=True))
    tensors[f"m.x.{part}"] = value(tensors[f"m.x.{part}"])
    with pytest.raises(CheckpointError) as info:
        read_gptq_tensors(DictSource(tensors), "m.x")
    for word in words:
        assert word in str(info.value)


# --- writing --------------------------------------------------------------------------------


def tiny_model_parts() -> tuple[dict[str, torch.Tensor], dict[str, GPTQTensors]]:
    dense = {
        "model.embed_tokens.weight": torch.randn(96, 64, dtype=torch.float16),
        "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(96, 64, dtype=torch.float16),
    }
    quantized = {
        f"model.layers.{i}.self_attn.{p}": random_part(64, 64, 32, bias=(p == "q_proj"), seed=i)
        for i in range(2)
        for p in ("q_proj", "o_proj")
    }
    return dense, quantized


@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 9000])
def test_save_load_round_trip(tmp_path: Path, max_shard_bytes: int) -> None:
    from pagedq.loader.weights import Checkpoint

    src = tmp_path / "src"
    write(src, "tokenizer.json", "{}")
    write(src, "tokenizer_config.json", {"eos_token": "</s>"})
    dense, quantized = tiny_model_parts()
    gptq = parse_gptq_config({**BASE, "group_size": 32, "desc_act": True, "sym": False})
    out = tmp_path / "out"
    config = {"model_type": "llama", "hidden_size": 64}
    save_gptq_model(
        out, config, dense, quantized, gptq, max_shard_bytes=max_shard_bytes, tokenizer_dir=src
    )
    sharded = max_shard_bytes < 10_000
    assert (out / INDEX_FILE).exists() == sharded and (out / SINGLE_FILE).exists() != sharded
    if sharded:
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    written = json.loads((out / "config.json").read_text())
    assert written["hidden_size"] == 64 and written["quantization_config"]["quant_method"] == "gptq"
    assert load_gptq_config(out) == gptq
    assert parse_gptq_config(written["quantization_config"]) == gptq  # both files agree
    ckpt = Checkpoint.open(out)
    for name, t in dense.items():
        assert ckpt.get(name).dtype == t.dtype and torch.equal(ckpt.get(name), t)
    for prefix, part in quantized.items():
        got = read_gptq_tensors(ckpt, prefix)
        assert torch.equal(got.qweight, part.qweight) and torch.equal(got.qzeros, part.qzeros)
        assert torch.equal(got.scales, part.scales)
        assert got.g_idx is not None and part.g_idx is not None
        assert torch.equal(got.g_idx, part.g_idx)
        assert (got.bias is None) == (part.bias is None)
        if got.bias is not None and part.bias is not None:
            assert torch.equal(got.bias, part.bias)


def test_written_config_parses_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    dense, quantized = tiny_model_parts()
    gptq = parse_gptq_config({**BASE, "group_size": 32, "desc_act": True})
    save_gptq_model(tmp_path, {"model_type": "llama"}, dense, quantized, gptq)
    raw = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    hf = transformers.GPTQConfig.from_dict(raw)
    assert (hf.bits, hf.group_size, hf.desc_act, hf.sym) == (4, 32, True, True)
    assert hf.format == "gptq"
