"""Read a Hugging Face `config.json` into pagedq's typed `ModelConfig`.

Both layouts transformers has written are accepted: 4.x (`rope_theta` and `rope_scaling` at the
top level, `torch_dtype`) and 5.x (`rope_parameters` holding `rope_theta` and the scaling fields,
`dtype`). Keys pagedq does not need are ignored, but every key that changes the function the model
computes and that pagedq cannot honour (a RoPE type, a sliding window, an activation, partial
rotary) is rejected with `UnsupportedModelError`, never silently dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pagedq.config import ModelConfig, RopeScaling
from pagedq.errors import (
    CheckpointError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# RoPE types pagedq computes; "dynamic" equals plain RoPE up to max_position_embeddings.
_SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_DTYPES = ("float16", "bfloat16", "float32")
# transformers' defaults for keys a config.json may leave out, per model_type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
    },
}


def load_model_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Read `model_dir/config.json` (and `generation_config.json` for extra eos ids)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist or is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelNotFoundError(f"{str(config_path)!r} not found: a model folder needs it")
    raw = read_json(config_path)
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else {}
    return parse_model_config(raw, generation, source=str(config_path))


def read_json(path: Path, error: type[ModelLoadError] = ModelLoadError) -> dict[str, Any]:
    """Parse a JSON object file; anything else raises `error` naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {str(path)!r} as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config.json"
) -> ModelConfig:
    """Build a `ModelConfig` from the parsed `config.json` dict (and `generation_config.json`)."""
    reader = _Reader(raw, source)
    architecture = _architecture(raw, source)
    model_type = "mistral" if architecture == "MistralForCausalLM" else "llama"
    reader.defaults = _DEFAULTS[model_type]
    _reject_unsupported(reader)
    num_heads = reader.positive_int("num_attention_heads")
    num_kv_heads = reader.positive_int("num_key_value_heads", default=num_heads)
    hidden_size = reader.positive_int("hidden_size")
    _check_heads(num_heads, num_kv_heads, source)
    rope_theta, rope_scaling = _rope(reader)
    max_positions = reader.positive_int("max_position_embeddings")
    if model_type == "mistral":  # transformers' Llama ignores sliding_window; Mistral honours it
        _check_sliding_window(reader, max_positions)
    eos_ids = _merge_ids(_token_ids(raw.get("eos_token_id"), "eos_token_id", source), generation)
    return ModelConfig(
        architecture=architecture,
        vocab_size=reader.positive_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=reader.positive_int("intermediate_size"),
        num_hidden_layers=reader.positive_int("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=_head_dim(reader, hidden_size, num_heads),
        rms_norm_eps=reader.positive_float("rms_norm_eps"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=reader.boolean("tie_word_embeddings", default=False),
        dtype=_dtype(raw, source),
        bos_token_id=_bos_id(raw.get("bos_token_id"), source),
        eos_token_ids=eos_ids,
        attention_bias=reader.boolean("attention_bias", default=False),
        mlp_bias=reader.boolean("mlp_bias", default=False),
    )


class _Reader:
    """Typed access to config keys, with per-model-type defaults and errors naming the key."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source
        self.defaults: dict[str, Any] = {}

    def value(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        if value is None:
            value = self.defaults.get(key, default)
        return value

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.value(key, default)
        if value is None:
            raise ModelLoadError(f"{self.source}: required key {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelLoadError(f"{self.source}: {key} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self.value(key, default)
        if value is None:
            raise ModelLoadError(f"{self.source}: required key {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{self.source}: {key} must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise ModelLoadError(f"{self.source}: {key} must be true or false, got {value!r}")
        return value


def _architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures")
    if architectures is None:
        model_type = raw.get("model_type")
        if model_type not in _ARCH_OF_MODEL_TYPE:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} with no 'architectures' is not supported; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return _ARCH_OF_MODEL_TYPE[model_type]
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise UnsupportedModelError(
            f"{source}: 'architectures' must name one architecture, got {architectures!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {architectures[0]!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(architectures[0])


def _reject_unsupported(reader: _Reader) -> None:
    """Keys that change the computed function in ways pagedq does not implement."""
    act = reader.raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{reader.source}: hidden_act {act!r} is not supported (silu)")
    rope = reader.raw.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", reader.raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(
            f"{reader.source}: partial_rotary_factor {partial!r} is not supported (only 1.0)"
        )


def _check_heads(num_heads: int, num_kv_heads: int, source: str) -> None:
    if num_heads % num_kv_heads != 0:
        raise CheckpointError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )


def _head_dim(reader: _Reader, hidden_size: int, num_heads: int) -> int:
    if reader.raw.get("head_dim") is not None:
        return reader.positive_int("head_dim")
    if hidden_size % num_heads != 0:
        raise CheckpointError(
            f"{reader.source}: hidden_size ({hidden_size}) is not a multiple of "
            f"num_attention_heads ({num_heads}) and no head_dim is given"
        )
    return hidden_size // num_heads


def _check_sliding_window(reader: _Reader, max_positions: int) -> None:
    # An explicit null means no window; a missing key means the model type's default.
    raw = reader.raw
    window = raw["sliding_window"] if "sliding_window" in raw else reader.value("sliding_window")
    if window is not None and (not isinstance(window, int) or window < max_positions):
        raise UnsupportedModelError(
            f"{reader.source}: sliding_window {window!r} is smaller than the context "
            f"(max_position_embeddings {max_positions}); sliding-window attention is not supported"
        )


def _rope(reader: _Reader) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from 5.x `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = reader.raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(f"{reader.source}: rope_parameters must be an object, got {params!r}")
    if params and "rope_theta" in params:
        theta_reader = _Reader(params, f"{reader.source} rope_parameters")
        theta = theta_reader.positive_float("rope_theta")
    else:
        theta = reader.positive_float("rope_theta")
    scaling = params if params else reader.raw.get("rope_scaling")
    return theta, _rope_scaling(scaling, reader.source)


def _rope_scaling(scaling: Any, source: str) -> RopeScaling | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    fields = _Reader(scaling, f"{source} rope scaling")
    factor = fields.positive_float("factor")
    if rope_type != "llama3":
        return RopeScaling(rope_type=rope_type, factor=factor)
    return RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=fields.positive_float("low_freq_factor"),
        high_freq_factor=fields.positive_float("high_freq_factor"),
        original_max_position_embeddings=fields.positive_int("original_max_position_embeddings"),
    )


def _dtype(raw: dict[str, Any], source: str) -> str | None:
    value = raw.get("dtype", raw.get("torch_dtype"))
    if value is None or value == "auto":
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise UnsupportedModelError(
            f"{source}: weight dtype {value!r} is not supported; supported: {', '.join(_DTYPES)}"
        )
    return name


def _bos_id(value: Any, source: str) -> int | None:
    ids = _token_ids(value, "bos_token_id", source)
    return ids[0] if ids else None


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    """An id, a list of ids or null, as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ModelLoadError(f"{source}: {key} must be a token id or a list of them: {value!r}")
    return tuple(items)


def _merge_ids(eos_ids: tuple[int, ...], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """eos ids of config.json, then any more named by generation_config.json, in order."""
    if not generation:
        return eos_ids
    extra = _token_ids(generation.get("eos_token_id"), "eos_token_id", "generation_config.json")
    return merge_unique(eos_ids, extra)


def merge_unique(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    """`first` followed by the items of `second` not already in it."""
    return first + tuple(dict.fromkeys(i for i in second if i not in first))
