"""GPTQ checkpoints on disk: reading the settings and tensors, writing a quantized model.

Settings are looked up in `quantize_config.json`, `quant_config.json`, then
`config.json["quantization_config"]`; the first one found wins (gptq-format.md). Written models
carry the settings both in `config.json["quantization_config"]` and in `quantize_config.json`,
because transformers/vLLM read the first and AutoGPTQ-era tools the second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedq.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from pagedq.gptq.config import DynamicRule, GPTQConfig, GPTQTensors

QUANT_FILES = ("quantize_config.json", "quant_config.json")  # looked up before config.json
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # v1: zeros stored minus one; v2: stored as is
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TensorSource(Protocol):
    """What `read_gptq_tensors` needs of a checkpoint (`pagedq.loader.weights.Checkpoint`)."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


# --- settings -------------------------------------------------------------------------------


def load_gptq_config(model_dir: str | os.PathLike[str]) -> GPTQConfig | None:
    """The GPTQ settings of a model folder, or None for an unquantized model.

    Raises `UnsupportedModelError` for settings pagedq cannot run (bits other than 4, a
    pack dtype other than int32, another quantization method such as AWQ, an unknown
    checkpoint format) and `CheckpointError` for unreadable or malformed files.
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    for name in QUANT_FILES:
        if (folder / name).is_file():
            return parse_gptq_config(_read_json(folder / name), source=name)
    if (folder / "config.json").is_file():
        qc = _read_json(folder / "config.json").get("quantization_config")
        if qc is not None:
            if not isinstance(qc, dict):
                raise CheckpointError(
                    f"config.json: quantization_config must be an object, got {type(qc).__name__}"
                )
            return parse_gptq_config(qc, source="config.json quantization_config")
    return None


def parse_gptq_config(raw: Mapping[str, Any], source: str = "quantization settings") -> GPTQConfig:
    """Validate one settings dictionary (any of the three files) into a `GPTQConfig`."""
    method = str(raw.get("quant_method", "gptq")).lower()
    if method != "gptq" or "w_bit" in raw:
        shown = "awq" if "w_bit" in raw and method == "gptq" else method
        raise UnsupportedModelError(
            f"{source}: quant_method={shown!r} is not supported; pagedq runs 'gptq' checkpoints"
        )
    if "bits" not in raw:
        raise CheckpointError(f"{source}: the GPTQ settings have no 'bits' field")
    bits = raw["bits"]
    if bits != 4:
        raise UnsupportedModelError(f"{source}: bits={bits!r} is not supported; pagedq runs 4-bit")
    pack_dtype = str(raw.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise UnsupportedModelError(
            f"{source}: pack_dtype={raw['pack_dtype']!r} is not supported; only int32 is"
        )
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if fmt not in CHECKPOINT_FORMATS:
        raise UnsupportedModelError(
            f"{source}: checkpoint_format={fmt!r} is not supported; expected one of "
            f"{list(CHECKPOINT_FORMATS)}"
        )
    return GPTQConfig(
        bits=4,
        group_size=_group_size(raw.get("group_size", -1), source),
        desc_act=_flag(raw, "desc_act", False, source),
        sym=_flag(raw, "sym", True, source),
        checkpoint_format=fmt,
        lm_head=_flag(raw, "lm_head", False, source),
        pack_dtype="int32",
        damp_percent=_number(raw, "damp_percent", 0.01, source),
        true_sequential=_flag(raw, "true_sequential", True, source),
        quantizer=_quantizer(raw, source),
        dynamic=_dynamic(raw, source),
    )


def gptq_config_dict(cfg: GPTQConfig) -> dict[str, Any]:
    """The settings as written to `quantization_config` and `quantize_config.json`."""
    return {
        "quant_method": "gptq",
        "bits": cfg.bits,
        "group_size": -1 if cfg.group_size is None else cfg.group_size,
        "desc_act": cfg.desc_act,
        "sym": cfg.sym,
        "checkpoint_format": cfg.checkpoint_format,
        "true_sequential": cfg.true_sequential,
        "damp_percent": cfg.damp_percent,
        "static_groups": False,
        "lm_head": cfg.lm_head,
        "pack_dtype": cfg.pack_dtype,
        "model_file_base_name": "model",
        "meta": {"quantizer": list(cfg.quantizer)},
        **({"dynamic": _dynamic_dict(cfg.dynamic)} if cfg.dynamic else {}),
    }


def _group_size(value: Any, source: str) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise UnsupportedModelError(
            f"{source}: group_size={value!r} is not supported; expected a positive integer or -1"
        )
    return None if value == -1 else value


def _flag(raw: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key}={value!r} must be true or false")
    return value


def _number(raw: Mapping[str, Any], key: str, default: float, source: str) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{source}: {key}={value!r} must be a number")
    return float(value)


def _quantizer(raw: Mapping[str, Any], source: str) -> tuple[str, ...]:
    """`meta.quantizer`: the "tool:version" entries of the tools that wrote the checkpoint (one
    string or a list; GPTQModel writes it, and v1 zeros depend on it, see zeros_by_word)."""
    meta = raw.get("meta")
    if meta is None:
        return ()
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: meta={meta!r} must be an object")
    value = meta.get("quantizer")
    entries = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise CheckpointError(
            f"{source}: meta.quantizer={value!r} must be a string or a list of strings"
        )
    return tuple(entries)


def _dynamic(raw: Mapping[str, Any], source: str) -> tuple[DynamicRule, ...]:
    """GPTQModel's `dynamic` settings: {"[+:|-:]regex": {overrides}}, in order (see DynamicRule).
    Overrides of bits, group_size, sym and desc_act are kept; other keys do not change how a
    checkpoint reads."""
    value = raw.get("dynamic")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: dynamic={value!r} must be an object of rules")
    rules = []
    for key, overrides in value.items():
        where = f"{source}: dynamic rule {key!r}"
        if not isinstance(overrides, dict):
            raise CheckpointError(f"{where} must map to an object, got {overrides!r}")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(pattern)
        except re.error as e:
            raise CheckpointError(f"{where} is not a valid regular expression: {e}") from None
        picked: list[tuple[str, int | bool | None]] = []
        if "bits" in overrides:
            bits = overrides["bits"]
            if isinstance(bits, bool) or not isinstance(bits, int):
                raise CheckpointError(f"{where}: bits={bits!r} must be an integer")
            picked.append(("bits", bits))
        if "group_size" in overrides:
            picked.append(("group_size", _group_size(overrides["group_size"], where)))
        picked += [
            (f, _flag(overrides, f, False, where)) for f in ("sym", "desc_act") if f in overrides
        ]
        rules.append(DynamicRule(pattern, key.startswith("-:"), tuple(picked)))
    return tuple(rules)


def _dynamic_dict(rules: tuple[DynamicRule, ...]) -> dict[str, dict[str, Any]]:
    out = {}
    for rule in rules:
        overrides = {k: -1 if k == "group_size" and v is None else v for k, v in rule.overrides}
        out[("-:" if rule.skip else "+:") + rule.pattern] = overrides
    return out


def _read_json(path: Path) -> dict[str, Any]:
    from pagedq.loader.hf_config import read_json

    return read_json(path, CheckpointError)


# --- reading tensors ------------------------------------------------------------------------


def read_gptq_tensors(ckpt: TensorSource, prefix: str) -> GPTQTensors:
    """The tensors of the quantized linear `prefix` (e.g. "model.layers.0.self_attn.q_proj").

    `g_idx` and `bias` are optional. Shapes must agree with each other (qweight [K/8, N],
    qzeros [G, N/8], scales [G, N], g_idx [K] with values in [0, G), bias [N]); scales and
    bias come back as fp16, g_idx as int32.
    """
    qweight = _int_tensor(ckpt, prefix, "qweight", required=True)
    qzeros = _int_tensor(ckpt, prefix, "qzeros", required=True)
    scales = _float_tensor(ckpt, prefix, "scales", required=True)
    g_idx = _int_tensor(ckpt, prefix, "g_idx", required=False)
    bias = _float_tensor(ckpt, prefix, "bias", required=False)
    assert qweight is not None and qzeros is not None and scales is not None
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise CheckpointError(
            f"{prefix}: qweight/qzeros must be int32 (pack_dtype int32), got "
            f"{qweight.dtype}/{qzeros.dtype}"
        )
    k, n = int(qweight.shape[0]) * 8, int(qweight.shape[1])
    groups = int(scales.shape[0])
    _check_shape(prefix, "scales", scales, (groups, n))
    _check_shape(prefix, "qzeros", qzeros, (groups, n // 8))
    if n % 8:
        raise CheckpointError(f"{prefix}: out_features={n} is not a multiple of 8")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        _check_shape(prefix, "g_idx", g_idx, (k,))
        lo, hi = int(g_idx.min()), int(g_idx.max())
        if lo < 0 or hi >= groups:
            raise CheckpointError(
                f"{prefix}.g_idx: values span [{lo}, {hi}], must lie in [0, {groups}) "
                f"(the number of groups in scales)"
            )
    if bias is not None:
        _check_shape(prefix, "bias", bias, (n,))
    return GPTQTensors(qweight, qzeros, scales.to(torch.float16), g_idx, bias)


def _fetch(ckpt: TensorSource, prefix: str, part: str, required: bool) -> torch.Tensor | None:
    name = f"{prefix}.{part}"
    if name not in ckpt:
        if required:
            raise CheckpointError(f"quantized tensor {name!r} is missing from the checkpoint")
        return None
    return ckpt.get(name)


def _int_tensor(ckpt: TensorSource, prefix: str, part: str, required: bool) -> torch.Tensor | None:
    t = _fetch(ckpt, prefix, part, required)
    if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise CheckpointError(f"{prefix}.{part} has dtype {t.dtype}, expected an integer dtype")
    return t


def _float_tensor(
    ckpt: TensorSource, prefix: str, part: str, required: bool
) -> torch.Tensor | None:
    t = _fetch(ckpt, prefix, part, required)
    if t is not None and not t.is_floating_point():
        raise CheckpointError(f"{prefix}.{part} has dtype {t.dtype}, expected float16")
    return t


def _check_shape(prefix: str, part: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise CheckpointError(
            f"{prefix}.{part} has shape {tuple(t.shape)}, expected {shape} "
            f"(from qweight {prefix}.qweight and scales)"
        )


# --- writing --------------------------------------------------------------------------------


def save_gptq_model(
    out_dir: str | os.PathLike[str],
    config_json: Mapping[str, Any],
    dense_tensors: Mapping[str, torch.Tensor],
    quantized: Mapping[str, GPTQTensors],
    gptq: GPTQConfig,
    *,
    max_shard_bytes: int = 2 << 30,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Write a GPTQ model folder that pagedq, transformers, GPTQModel and vLLM can load.

    `dense_tensors` are written under their own names (embeddings, norms, lm_head), each
    `quantized[prefix]` as `prefix.{qweight,qzeros,scales,g_idx[,bias]}`. Weights go to
    `model.safetensors`, or to shards of at most `max_shard_bytes` plus an index when larger.
    `config_json` (the source config.json) gains `quantization_config`; tokenizer files are
    copied from `tokenizer_dir` when given.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(dense_tensors)
    for prefix, q in quantized.items():
        tensors.update(_quantized_entries(prefix, q))
    _write_weights(out, tensors, max_shard_bytes)
    settings = gptq_config_dict(gptq)
    config = dict(config_json)
    config["quantization_config"] = settings
    _write_json(out / "config.json", config)
    _write_json(out / QUANT_FILES[0], settings)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)


def save_from_source(
    src_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    quantized: Mapping[str, GPTQTensors],
    gptq: GPTQConfig,
) -> None:
    """Write `quantized` plus every other tensor of the dense folder `src_dir` as a GPTQ folder.

    The source `{prefix}.weight` of each quantized projection is dropped and its `.bias` (if
    any) goes with the quantized tensors; other tensors keep their dtype, except fp32 which
    becomes fp16 (config.json's dtype follows). config.json and tokenizer files come along.
    """
    from pagedq.loader.weights import Checkpoint

    src = Path(src_dir)
    ckpt = Checkpoint.open(src)
    replaced = {f"{p}.{part}" for p in quantized for part in ("weight", "bias")}
    dense = {}
    for name in ckpt.names():
        if name not in replaced:
            t = ckpt.get(name)
            dense[name] = t.to(torch.float16) if t.dtype == torch.float32 else t
    parts = {
        p: replace(q, bias=ckpt.get(f"{p}.bias")) if f"{p}.bias" in ckpt else q
        for p, q in quantized.items()
    }
    config = _read_json(src / "config.json")
    dtype = str(dense["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
        config[key] = dtype
    save_gptq_model(out_dir, config, dense, parts, gptq, tokenizer_dir=src)


def copy_tokenizer_files(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer and generation files present in `src` to `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def _quantized_entries(prefix: str, q: GPTQTensors) -> dict[str, torch.Tensor]:
    entries = {
        f"{prefix}.qweight": q.qweight.to(torch.int32),
        f"{prefix}.qzeros": q.qzeros.to(torch.int32),
        f"{prefix}.scales": q.scales.to(torch.float16),
    }
    if q.g_idx is not None:
        entries[f"{prefix}.g_idx"] = q.g_idx.to(torch.int32)
    if q.bias is not None:
        entries[f"{prefix}.bias"] = q.bias.to(torch.float16)
    return entries


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """One `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus an index."""
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards = _plan_shards(tensors, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(_contiguous(tensors, shards[0]), str(out / SINGLE_FILE), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_contiguous(tensors, names), str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(_nbytes(t) for t in tensors.values())
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in sorted order, cut into runs of at most `max_bytes` (a larger tensor: alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = _nbytes(tensors[name])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _contiguous(tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    # safetensors refuses views that share storage: give every tensor its own copy.
    return {n: tensors[n].detach().to("cpu").contiguous().clone() for n in names}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
