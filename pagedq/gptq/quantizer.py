"""GPTQ (Frantar et al., 2022) and round-to-nearest 4-bit quantization of Llama checkpoints.

Per linear layer (weight W [N, K]) GPTQ takes the Hessian of the layer's reconstruction error,
H = 2 XᵀX / n over the calibration tokens X [n, K], and quantizes W one input column at a time,
spreading each column's rounding error over the columns not yet quantized through the upper
Cholesky factor of H⁻¹ (blocks of 128 columns, lazy batch updates). Whole models are quantized
layer by layer; each layer sees inputs produced by the already-quantized layers before it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from pagedq import __version__
from pagedq.errors import ConfigError, UnsupportedModelError
from pagedq.gptq.calibration import calibration_windows, check_tokens
from pagedq.gptq.config import GPTQConfig, GPTQTensors
from pagedq.gptq.rtn import (
    GridSpec,
    dequantize_grid,
    find_grid,
    group_index,
    pack_gptq,
    quantize_to_grid,
    rtn_columns,
    split_gptq,
)
from pagedq.layers.linear import DenseLinear

if TYPE_CHECKING:
    from pagedq.config import ModelConfig
    from pagedq.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
    from pagedq.ops.attention import AttentionMetadata

BLOCK = 128  # columns per lazy-update block
METHODS = ("gptq", "rtn")
FORMATS = ("gptq", "gptq_v2")
MAX_DAMP = 1.0  # dampening is raised tenfold up to this while H stays singular


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    """How to quantize a model; validated on construction (ConfigError names value and limit)."""

    bits: int = 4  # only 4
    group_size: int | None = 128  # input columns per scale/zero; None: one group over all K
    desc_act: bool = False  # act-order: quantize columns by descending Hessian diagonal
    sym: bool = True  # symmetric grid (zero fixed at 8)
    damp_percent: float = 0.01  # added to diag(H), as a fraction of its mean
    samples: int = 128  # calibration windows
    seq_len: int = 512  # tokens per calibration window
    true_sequential: bool = True  # q/k/v, then o, then gate/up, then down, each on quantized inputs
    checkpoint_format: str = "gptq"  # "gptq" (v1, zero stored minus one) or "gptq_v2"
    seed: int = 0  # picks the calibration windows
    method: str = "gptq"  # "gptq" or "rtn" (round-to-nearest, no calibration)

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ConfigError(f"bits={self.bits} is not supported; pagedq quantizes to 4 bits")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or self.group_size < 1
        ):
            raise ConfigError(f"group_size={self.group_size} must be a positive integer or None")
        if not 0.0 < self.damp_percent <= MAX_DAMP:
            raise ConfigError(f"damp_percent={self.damp_percent} must lie in (0, {MAX_DAMP}]")
        if self.samples < 1:
            raise ConfigError(f"samples={self.samples} must be at least 1")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len={self.seq_len} must be at least 2")
        if self.checkpoint_format not in FORMATS:
            raise ConfigError(
                f"checkpoint_format={self.checkpoint_format!r} must be one of {list(FORMATS)}"
            )
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} must be one of {list(METHODS)}")

    @property
    def zero_offset(self) -> int:
        return self.gptq_config().zero_offset

    @property
    def grid(self) -> GridSpec:
        v1_asym = not self.sym and self.checkpoint_format == "gptq"
        return GridSpec(bits=self.bits, sym=self.sym, min_zero=1 if v1_asym else 0)

    def gptq_config(self) -> GPTQConfig:
        """The settings written into the quantized checkpoint."""
        return GPTQConfig(
            bits=self.bits,
            group_size=self.group_size,
            desc_act=self.desc_act and self.method == "gptq",
            sym=self.sym,
            checkpoint_format=self.checkpoint_format,
            lm_head=False,
            damp_percent=self.damp_percent,
            true_sequential=self.true_sequential,
            quantizer=(f"pagedq:{__version__}",),
        )


# --- one weight ----------------------------------------------------------------------------


def gptq_quantize_weight(
    w: torch.Tensor,  # [N, K] any float dtype
    H: torch.Tensor,  # [K, K] Hessian 2XᵀX/n of the layer input
    opts: QuantizeOptions,
) -> tuple[GPTQTensors, torch.Tensor]:
    """GPTQ one weight: `(packed tensors, dequantized weight [N, K] fp32)`.

    The dequantized weight is exactly what the packed tensors dequantize to (fp16 scales).
    Inputs whose Hessian diagonal is 0 (never active) get weight 0.
    """
    _, k = _check_weight(w)
    if tuple(H.shape) != (k, k):
        raise ValueError(f"Hessian has shape {tuple(H.shape)}, expected {(k, k)} for K={k}")
    w = w.detach().to(torch.float32).clone()
    h = H.detach().to(torch.float32).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = None
    if opts.desc_act:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    hinv = inverse_cholesky(h, opts.damp_percent)
    q, scales, zeros = _gptq_columns(w, hinv, opts.group_size, opts.grid)
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    g_idx = group_index(k, opts.group_size, perm)
    packed = pack_gptq(q, scales, zeros, g_idx, opts.zero_offset)
    return packed, dequantize_grid(q, scales, zeros, g_idx)


def rtn_quantize_weight(
    w: torch.Tensor,  # [N, K] any float dtype
    opts: QuantizeOptions,
) -> tuple[GPTQTensors, torch.Tensor]:
    """Round each group to its nearest grid points: `(packed, dequantized [N, K] fp32)`."""
    _, k = _check_weight(w)
    q, scales, zeros = rtn_columns(w.detach().to(torch.float32), opts.group_size, opts.grid)
    g_idx = group_index(k, opts.group_size, None)
    packed = pack_gptq(q, scales, zeros, g_idx, opts.zero_offset)
    return packed, dequantize_grid(q, scales, zeros, g_idx)


def inverse_cholesky(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹ [K, K].

    If H is numerically singular the dampening is raised tenfold (up to `MAX_DAMP`).
    """
    k = h.shape[0]
    mean_diag = torch.diagonal(h).mean()
    damp = damp_percent
    while True:
        hd = h + damp * mean_diag * torch.eye(k, dtype=h.dtype, device=h.device)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and bool(torch.isfinite(upper).all()):
                return upper
        if damp >= MAX_DAMP:
            raise ConfigError(
                f"the Hessian (K={k}) is not positive definite even with damp_percent={damp}; "
                "the calibration inputs of this layer are degenerate (NaN/inf or constant)"
            )
        damp = min(damp * 10.0, MAX_DAMP)


def _gptq_columns(
    w: torch.Tensor,  # [N, K] fp32, modified in place (columns in quantization order)
    hinv: torch.Tensor,  # [K, K] upper Cholesky factor of H⁻¹
    group_size: int | None,
    spec: GridSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GPTQ column loop: `(q [N, K] grid ints, scales [G, N], zeros [G, N])`.

    A group's grid is chosen when its first column comes up, from the weights as updated by
    every column quantized so far (exactly as the unblocked algorithm would see them, also
    for a group that reaches past the current block).
    """
    k = w.shape[1]
    gs = k if group_size is None else group_size
    q = torch.zeros_like(w)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        w1 = w[:, i1:i2].clone()  # [N, B]: this block, updated column by column
        err = torch.zeros_like(w1)  # [N, B]: scaled errors, for the lazy update of w[:, i2:]
        h1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:
                ahead = w[:, i2 : col + gs]  # group columns past this block: apply the
                ahead = ahead - err[:, :i] @ hinv[i1:col, i2 : col + gs]  # pending update
                group = torch.cat([w1[:, i : i + gs], ahead], dim=1)
                scale, zero = find_grid(group, spec)
                scales.append(scale)
                zeros.append(zero)
            qi = quantize_to_grid(w1[:, i], scale, zero, spec.maxq)  # [N]
            q[:, col] = qi
            e = (w1[:, i] - scale * (qi - zero)) / h1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    return q, torch.stack(scales), torch.stack(zeros)


def _check_weight(w: torch.Tensor) -> tuple[int, int]:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got {w.dtype} {list(w.shape)}")
    n, k = int(w.shape[0]), int(w.shape[1])
    if n % 8 or k % 8:
        raise UnsupportedModelError(
            f"a {n}x{k} (out x in) weight cannot be packed: both sizes must be multiples of 8"
        )
    return n, k


# --- whole models ---------------------------------------------------------------------------


def quantize_model(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    opts: QuantizeOptions | None = None,
    calibration_text: str | None = None,
    progress: bool = True,
    *,
    calibration_tokens: torch.Tensor | None = None,
) -> Path:
    """Quantize the dense Llama folder `model_dir` into a GPTQ folder `out_dir`; returns it.

    Calibration: `calibration_tokens` [samples, seq_len] int64 when given, else `opts.samples`
    seeded random windows of `opts.seq_len` tokens of `calibration_text` (default: the bundled
    text) under the model's own tokenizer. `method="rtn"` needs no calibration. The
    unquantized tensors keep their dtype (fp32 becomes fp16); lm_head stays unquantized.
    """
    from pagedq.gptq.checkpoint import load_gptq_config, save_from_source
    from pagedq.models.llama import load_llama

    opts = opts or QuantizeOptions()
    src, out = Path(model_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {str(out)!r} exists and is not empty")
    if load_gptq_config(src) is not None:
        raise UnsupportedModelError(f"{str(src)!r} is already GPTQ-quantized")
    model = load_llama(src, torch.float32, "cpu")
    if opts.method == "rtn":
        quantized = _rtn_model(model, opts, progress)
    else:
        if calibration_tokens is None:
            calibration_tokens = calibration_windows(
                src, calibration_text, opts.samples, opts.seq_len, opts.seed
            )
        check_tokens(calibration_tokens, model.config.vocab_size)
        quantized = _gptq_model(model, calibration_tokens, opts, progress)
    save_from_source(src, out, quantized, opts.gptq_config())
    return out


# --- layer by layer -------------------------------------------------------------------------

# pagedq's fused modules in a decoder layer -> the checkpoint projections they hold, row order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
TOKENS_PER_BATCH = 4096  # calibration tokens run through a layer at once


class _StopForward(Exception):
    """Raised by a pre-hook once the input of the module it watches is captured."""


class _Batches:
    """The calibration windows as flat batches, with the attention set-up of each batch size."""

    def __init__(self, config: ModelConfig, tokens: torch.Tensor) -> None:
        from pagedq.models.llama import contiguous_positions, contiguous_prefill

        self.seq_len = int(tokens.shape[1])
        rows = max(1, TOKENS_PER_BATCH // self.seq_len)
        one_layer = replace(config, num_hidden_layers=1)  # one throwaway KV cache suffices
        self.tokens = [t.reshape(-1) for t in tokens.split(rows)]  # each [b * seq_len]
        self.setups: dict[int, tuple[torch.Tensor, KVCache, AttentionMetadata]] = {}
        for n in {int(t.shape[0]) for t in self.tokens}:
            lens = [self.seq_len] * (n // self.seq_len)
            meta, kv = contiguous_prefill(lens, one_layer, torch.float32, "cpu")
            self.setups[n] = (contiguous_positions(lens, "cpu"), kv[0], meta)

    def attention_input_of_o(self, attn: LlamaAttention, x: torch.Tensor) -> torch.Tensor:
        """Attention up to o_proj: normed hidden [T, H] -> o_proj's input [T, heads * D]."""
        positions, kv, meta = self.setups[int(x.shape[0])]
        return _input_of(attn.o_proj, lambda: attn(positions, x, kv, meta))


def _input_of(module: torch.nn.Module, call: Callable[[], object]) -> torch.Tensor:
    """Run `call` until `module` is about to run; return the input it would have received."""
    captured: list[torch.Tensor] = []

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0])
        raise _StopForward

    handle = module.register_forward_pre_hook(hook)
    try:
        with contextlib.suppress(_StopForward):
            call()
    finally:
        handle.remove()
    assert len(captured) == 1, "the module must run exactly once per call"
    return captured[0]


def _gptq_model(
    model: LlamaForCausalLM, tokens: torch.Tensor, opts: QuantizeOptions, progress: bool
) -> dict[str, GPTQTensors]:
    """Quantize every decoder layer in order, each on the outputs of the quantized ones."""
    batches = _Batches(model.config, tokens)
    hidden = [model.embed_tokens(t) for t in batches.tokens]  # [b * seq_len, H] each
    result: dict[str, GPTQTensors] = {}
    layers = list(model.layers)
    with torch.no_grad():
        for i, layer in enumerate(tqdm(layers, desc="GPTQ", unit="layer", disable=not progress)):
            hidden, packed = _quantize_layer(layer, hidden, batches, opts)
            for name, tensors in packed.items():
                result.update(_split(model.config, i, name, tensors))
    return result


def _quantize_layer(
    layer: LlamaDecoderLayer, hidden: list[torch.Tensor], batches: _Batches, opts: QuantizeOptions
) -> tuple[list[torch.Tensor], dict[str, GPTQTensors]]:
    """GPTQ one decoder layer; returns its outputs (from the quantized weights) and tensors.

    With `true_sequential` each projection is quantized as soon as its inputs are known, so
    the stages after it see its quantized output (one pass); otherwise every Hessian comes
    from the dense layer and a second pass computes the outputs.
    """
    packed: dict[str, GPTQTensors] = {}

    def quantize(name: str, inputs: list[torch.Tensor]) -> None:
        packed[name] = _quantize_module(layer, name, _hessian(inputs), opts)

    if opts.true_sequential:
        return run_staged(layer, hidden, batches, quantize), packed
    hessians: dict[str, torch.Tensor] = {}
    run_staged(layer, hidden, batches, lambda name, x: hessians.__setitem__(name, _hessian(x)))
    for name, h in hessians.items():
        packed[name] = _quantize_module(layer, name, h, opts)
    return run_staged(layer, hidden, batches, lambda name, x: None), packed


def run_staged(
    layer: LlamaDecoderLayer,
    hidden: list[torch.Tensor],  # [T, H] per batch
    batches: _Batches,
    stage: Callable[[str, list[torch.Tensor]], None],
) -> list[torch.Tensor]:
    """The pre-norm Llama block, one projection at a time over all batches: [T, H] each.

    `stage(name, inputs)` sees the inputs of each fused projection (q/k/v, o, gate/up, down)
    before the projection runs, so it may replace the projection's weight.
    """
    attn, mlp = layer.self_attn, layer.mlp
    x = [layer.input_layernorm(h) for h in hidden]  # [T, H]
    stage("self_attn.qkv_proj", x)
    x = [batches.attention_input_of_o(attn, xi) for xi in x]  # [T, heads * D]
    stage("self_attn.o_proj", x)
    mid = [h + attn.o_proj(xi) for h, xi in zip(hidden, x, strict=True)]  # after attention
    x = [layer.post_attention_layernorm(h) for h in mid]  # [T, H]
    stage("mlp.gate_up_proj", x)
    x = [_input_of(mlp.down_proj, partial(mlp, xi)) for xi in x]  # [T, I]
    stage("mlp.down_proj", x)
    return [h + mlp.down_proj(xi) for h, xi in zip(mid, x, strict=True)]


def _hessian(inputs: list[torch.Tensor]) -> torch.Tensor:
    """H = 2XᵀX/n [K, K] fp32 over all calibration tokens (rows of the [T, K] inputs)."""
    total = sum(int(x.shape[0]) for x in inputs)
    acc = torch.zeros(inputs[0].shape[-1], inputs[0].shape[-1])
    for x in inputs:
        x = x.float()
        acc.addmm_(x.t(), x)
    return acc.mul_(2.0 / total)


def _quantize_module(
    layer: LlamaDecoderLayer, name: str, hessian: torch.Tensor, opts: QuantizeOptions
) -> GPTQTensors:
    """GPTQ the fused projection `name`; its weight becomes the dequantized one, in place."""
    module = _dense(layer, name)
    packed, deq = gptq_quantize_weight(module.weight, hessian, opts)
    module.weight.data.copy_(deq)
    return packed


def _rtn_model(
    model: LlamaForCausalLM, opts: QuantizeOptions, progress: bool
) -> dict[str, GPTQTensors]:
    result: dict[str, GPTQTensors] = {}
    layers = list(model.layers)
    for i, layer in enumerate(tqdm(layers, desc="RTN", unit="layer", disable=not progress)):
        for name in FUSED:
            packed, _ = rtn_quantize_weight(_dense(layer, name).weight, opts)
            result.update(_split(model.config, i, name, packed))
    return result


def _dense(layer: torch.nn.Module, name: str) -> DenseLinear:
    module = layer.get_submodule(name)
    if not isinstance(module, DenseLinear):
        raise UnsupportedModelError(f"{name} is a {type(module).__name__}, not a dense linear")
    return module


def _split(
    config: ModelConfig, layer: int, fused: str, packed: GPTQTensors
) -> dict[str, GPTQTensors]:
    """Checkpoint name -> tensors for the projections held by the fused module `fused`."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    sizes = {
        "self_attn.qkv_proj": [q, kv, kv],
        "self_attn.o_proj": [config.hidden_size],
        "mlp.gate_up_proj": [config.intermediate_size] * 2,
        "mlp.down_proj": [config.hidden_size],
    }[fused]
    parts = split_gptq(packed, sizes)
    return {f"model.layers.{layer}.{n}": p for n, p in zip(FUSED[fused], parts, strict=True)}
