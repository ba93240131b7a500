"""End to end: a GPTQ folder written by pagedq's quantizer gives, in pagedq, the greedy tokens
that transformers gives when it runs the same weights dequantized into a dense folder."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedq import LLM, SamplingParams
from pagedq.errors import CheckpointError, UnsupportedModelError
from pagedq.gptq.checkpoint import load_gptq_config, read_gptq_tensors
from pagedq.gptq.format import dequantize
from pagedq.gptq.linear import GPTQLinear
from pagedq.gptq.quantizer import QuantizeOptions, quantize_model, rtn_quantize_weight
from pagedq.layers.linear import ConcatLinear
from pagedq.loader.weights import Checkpoint
from pagedq.models.llama import load_llama
from tests.test_engine_hf import assert_agrees
from tests.tiny_models import hf_greedy, hf_model, make_tiny_llama

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def dense_copy(gptq_dir: Path, out: Path) -> Path:
    """The GPTQ folder with every quantized linear dequantized to fp32 (a plain HF folder)."""
    out.mkdir()
    ckpt, cfg = Checkpoint.open(gptq_dir), load_gptq_config(gptq_dir)
    assert cfg is not None
    tensors: dict[str, torch.Tensor] = {}
    for name in ckpt.names():
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("qweight", "qzeros", "scales", "g_idx"):
            if leaf == "qweight":
                t = read_gptq_tensors(ckpt, prefix)
                k = t.in_features
                g_idx = t.g_idx if t.g_idx is not None else torch.arange(k) // (cfg.group_size or k)
                w_t = dequantize(t.qweight, t.qzeros, t.scales, g_idx, cfg.zero_offset)
                tensors[f"{prefix}.weight"] = w_t.t().contiguous()
            continue
        tensors[name] = ckpt.get(name).float()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((gptq_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if "lm_head.weight" in tensors:  # a quantized head of a tied model is its own weight
        config["tie_word_embeddings"] = False
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (out / extra).write_bytes((gptq_dir / extra).read_bytes())
    return out


@pytest.mark.parametrize(
    "opts",
    [
        QuantizeOptions(group_size=32, sym=True),
        QuantizeOptions(group_size=32, sym=False, desc_act=True),
        QuantizeOptions(group_size=None, checkpoint_format="gptq_v2"),
    ],
    ids=["g32-sym", "g32-asym-act", "g-1-v2"],
)
def test_gptq_model_greedy_matches_transformers_on_dequantized_weights(
    tmp_path: Path, opts: QuantizeOptions
) -> None:
    src = make_tiny_llama(tmp_path / "src", hidden_size=64, num_heads=4, num_kv_heads=2)
    calib = torch.randint(3, 384, (8, 32), generator=torch.Generator().manual_seed(0))
    gptq_dir = quantize_model(src, tmp_path / "q", opts, progress=False, calibration_tokens=calib)
    assert all(f"model.layers.0.{p}.qweight" in Checkpoint.open(gptq_dir) for p in PROJECTIONS)
    prompts = [[5, 9, 33, 2 + i, 100 + 7 * i] * (1 + i) for i in range(4)]
    assert_greedy_matches_dense(gptq_dir, tmp_path / "dense", prompts, steps=16, num_blocks=64)


def assert_greedy_matches_dense(
    gptq_dir: Path, dense_dir: Path, prompts: list[list[int]], steps: int, num_blocks: int
) -> None:
    """pagedq on `gptq_dir` gives transformers' greedy tokens and top-5 log-probs on the same
    weights dequantized into `dense_dir`."""
    dense = dense_copy(gptq_dir, dense_dir)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5)
    llm = LLM(str(gptq_dir), device="cpu", num_blocks=num_blocks)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(dense)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_lp = hf_greedy(hf, prompt, steps)
        got = out.outputs[0]
        assert got.logprobs is not None
        assert_agrees(got.token_ids, got.logprobs, ref, ref_lp)


def rewrite(gptq_dir: Path, tensors: dict[str, torch.Tensor], **settings: object) -> None:
    """Replace the folder's weights and set `settings` in both of its GPTQ settings files."""
    save_file(tensors, str(gptq_dir / "model.safetensors"))
    for name in ("config.json", "quantize_config.json"):
        raw = json.loads((gptq_dir / name).read_text())
        raw.get("quantization_config", raw).update(settings)
        (gptq_dir / name).write_text(json.dumps(raw))


def quantize_lm_head(gptq_dir: Path, opts: QuantizeOptions) -> None:
    """Quantize the folder's lm_head too (round to nearest; the embeddings when tied) and say so
    in the settings, as GPTQModel's `lm_head=True` does."""
    ckpt = Checkpoint.open(gptq_dir)
    tensors = {name: ckpt.get(name) for name in ckpt.names()}
    head = tensors.pop("lm_head.weight", tensors["model.embed_tokens.weight"])
    packed, _ = rtn_quantize_weight(head, opts)
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        tensors[f"lm_head.{leaf}"] = getattr(packed, leaf)
    rewrite(gptq_dir, tensors, lm_head=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantized_lm_head_matches_transformers(tmp_path: Path, tied: bool) -> None:
    src = make_tiny_llama(
        tmp_path / "src", hidden_size=64, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied
    )
    opts = QuantizeOptions(group_size=32, method="rtn", sym=False)
    gptq_dir = quantize_model(src, tmp_path / "q", opts, progress=False)
    quantize_lm_head(gptq_dir, opts)
    cfg = load_gptq_config(gptq_dir)
    assert cfg is not None and cfg.lm_head
    assert "lm_head.weight" not in Checkpoint.open(gptq_dir)
    assert isinstance(load_llama(gptq_dir, torch.float32).lm_head, GPTQLinear)
    prompts = [[5, 9, 33, 2, 100], [7, 8, 9] * 5]
    assert_greedy_matches_dense(gptq_dir, tmp_path / "dense", prompts, steps=12, num_blocks=32)


def test_dynamic_rules_leave_linears_dense_or_regroup_them(tmp_path: Path) -> None:
    """GPTQModel's per-module rules: layer 0's k_proj stays dense inside the fused q/k/v, layer
    1's down_proj uses 64-row groups; pagedq still gives transformers' tokens."""
    src = make_tiny_llama(tmp_path / "src", hidden_size=64, num_heads=4, num_kv_heads=2)
    opts = QuantizeOptions(group_size=32, method="rtn")
    gptq_dir = quantize_model(src, tmp_path / "q", opts, progress=False)
    ckpt, dense_src = Checkpoint.open(gptq_dir), Checkpoint.open(src)
    tensors = {name: ckpt.get(name) for name in ckpt.names()}
    k_proj, down = "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{k_proj}.{leaf}"]
    tensors[f"{k_proj}.weight"] = dense_src.get(f"{k_proj}.weight").half()
    g64 = replace(opts, group_size=64)
    regrouped, _ = rtn_quantize_weight(dense_src.get(f"{down}.weight"), g64)
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        tensors[f"{down}.{leaf}"] = getattr(regrouped, leaf)
    rules = {r"-:.*\.0\.self_attn\.k_proj": {}, r"+:.*\.1\.mlp\.down_proj": {"group_size": 64}}
    rewrite(gptq_dir, tensors, dynamic=rules)
    model = load_llama(gptq_dir, torch.float32)
    assert isinstance(model.layers[0].self_attn.qkv_proj, ConcatLinear)
    prompts = [[5, 9, 33, 2, 100], [7, 8, 9] * 5]
    assert_greedy_matches_dense(gptq_dir, tmp_path / "dense", prompts, steps=12, num_blocks=32)
    rewrite(gptq_dir, tensors, dynamic={**rules, r".*\.1\.mlp\.up_proj": {"bits": 8}})
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.mlp\.up_proj: bits=8"):
        load_llama(gptq_dir, torch.float32)
    rewrite(gptq_dir, tensors, dynamic={r"-:.*\.mlp\.": {}})  # says dense, stored quantized
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj: stored"):
        load_llama(gptq_dir, torch.float32)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU tensors run Triton interpreted only without CUDA"
)
def test_gptq_engine_on_triton_interpreter_matches_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_tiny_llama(tmp_path / "src", hidden_size=64, num_heads=4, num_kv_heads=2)
    gptq_dir = quantize_model(
        src, tmp_path / "q", QuantizeOptions(group_size=32, method="rtn"), progress=False
    )
    prompts = [[5, 9, 33, 2, 100], [7] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = LLM(str(gptq_dir), device="cpu", num_blocks=32).generate(prompts, params)
    monkeypatch.setenv("PAGEDQ_GPTQ_BACKEND", "triton")
    got = LLM(str(gptq_dir), device="cpu", num_blocks=32).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
