"""The GPTQ / RTN quantizer: one weight against references, and whole tiny Llamas end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import pagedq
from pagedq.errors import ConfigError, UnsupportedModelError
from pagedq.gptq import calibration
from pagedq.gptq import quantizer as Q
from pagedq.gptq.checkpoint import load_gptq_config, read_gptq_tensors
from pagedq.gptq.format import dequantize, unpack_cols, unpack_rows
from pagedq.gptq.quantizer import QuantizeOptions, gptq_quantize_weight, rtn_quantize_weight
from pagedq.gptq.rtn import find_grid, quantize_to_grid

N, K, T = 64, 256, 1024


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [N, K] and correlated inputs X [T, K] with a few outlier channels; H = 2XᵀX/T."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, 16, generator=gen) @ torch.randn(16, K, generator=gen)
    x += 0.2 * torch.randn(T, K, generator=gen)
    x[:, :4] *= 8.0
    w = 0.05 * torch.randn(N, K, generator=gen)
    return w, x, 2.0 * x.t() @ x / T


def output_error(x: torch.Tensor, w: torch.Tensor, deq: torch.Tensor) -> float:
    return float((x @ (w - deq).t()).norm() / (x @ w.t()).norm())


def reference_gptq(w: torch.Tensor, h: torch.Tensor, opts: QuantizeOptions) -> torch.Tensor:
    """Unblocked GPTQ, straight from the paper: every column updates all later ones at once."""
    w, k = w.clone(), w.shape[1]
    gs = opts.group_size or k
    perm = torch.arange(k)
    if opts.desc_act:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    w, h = w[:, perm], h[perm][:, perm]
    u = Q.inverse_cholesky(h, opts.damp_percent)
    q = torch.zeros_like(w)
    for j in range(k):
        if j % gs == 0:
            scale, zero = find_grid(w[:, j : j + gs], opts.grid)
        q[:, j] = quantize_to_grid(w[:, j], scale, zero, 15)
        err = (w[:, j] - scale * (q[:, j] - zero)) / u[j, j]
        w[:, j:] -= err[:, None] * u[j, j:][None, :]
    return q[:, torch.argsort(perm)]


# --- options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"bits": 8}, ["bits=8", "4"]),
        ({"group_size": 0}, ["group_size=0"]),
        ({"damp_percent": 0.0}, ["damp_percent=0.0", "(0, 1.0]"]),
        ({"damp_percent": 2.0}, ["damp_percent=2.0"]),
        ({"samples": 0}, ["samples=0"]),
        ({"seq_len": 1}, ["seq_len=1"]),
        ({"checkpoint_format": "marlin"}, ["'marlin'", "gptq_v2"]),
        ({"method": "awq"}, ["'awq'", "rtn"]),
    ],
)
def test_options_rejected(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        QuantizeOptions(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


def test_weight_shape_rejected() -> None:
    with pytest.raises(UnsupportedModelError, match="12x64"):
        rtn_quantize_weight(torch.randn(12, 64), QuantizeOptions())
    with pytest.raises(ValueError, match="Hessian"):
        gptq_quantize_weight(torch.randn(8, 64), torch.eye(32), QuantizeOptions())


# --- one weight -----------------------------------------------------------------------------

VARIANTS = [
    pytest.param(gs, sym, act, id=f"g{gs}-{'sym' if sym else 'asym'}-{'act' if act else 'seq'}")
    for gs in (32, 64, None)
    for sym in (True, False)
    for act in (False, True)
]


@pytest.mark.parametrize(("gs", "sym", "act"), VARIANTS)
def test_gptq_beats_rtn(layer, gs: int | None, sym: bool, act: bool) -> None:
    w, x, h = layer
    opts = QuantizeOptions(group_size=gs, sym=sym, desc_act=act)
    _, deq = gptq_quantize_weight(w, h, opts)
    _, deq_rtn = rtn_quantize_weight(w, opts)
    # On correlated inputs GPTQ's error is far below RTN's (about half here).
    assert output_error(x, w, deq) < 0.75 * output_error(x, w, deq_rtn)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize(("gs", "sym", "act"), VARIANTS)
def test_packed_tensors_on_grid(layer, gs: int | None, sym: bool, act: bool, fmt: str) -> None:
    w, _, h = layer
    opts = QuantizeOptions(group_size=gs, sym=sym, desc_act=act, checkpoint_format=fmt)
    for packed, deq in (gptq_quantize_weight(w, h, opts), rtn_quantize_weight(w, opts)):
        groups = 1 if gs is None else K // gs
        assert packed.qweight.shape == (K // 8, N) and packed.qweight.dtype == torch.int32
        assert packed.qzeros.shape == (groups, N // 8) and packed.scales.shape == (groups, N)
        assert packed.scales.dtype == torch.float16 and packed.g_idx is not None
        # The returned weight is exactly what the checkpoint dequantizes to.
        g_idx = packed.g_idx
        on_disk = dequantize(packed.qweight, packed.qzeros, packed.scales, g_idx, opts.zero_offset)
        assert torch.equal(on_disk.t(), deq)
        zeros = unpack_cols(packed.qzeros) + opts.zero_offset  # [G, N] real zeros
        if sym:
            assert bool((zeros == 8).all())
            stored = 0x77777777 if fmt == "gptq" else 0x88888888 - 2**32  # int32 words
            assert bool((packed.qzeros == stored).all())
        if fmt == "gptq" and not sym:
            assert int(zeros.min()) >= 1  # v1 cannot store a zero of 0
        # Every weight is scale * (integer in 0..15 - zero) of its own group.
        scales = packed.scales.float()[g_idx.long()].t()  # [N, K]
        steps = deq / scales + zeros[g_idx.long()].t()
        assert torch.equal(steps, steps.round()) and 0 <= int(steps.min()) <= int(steps.max()) <= 15


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("gs", [32, None])
def test_g_idx(layer, gs: int | None, act: bool) -> None:
    w, _, h = layer
    packed, _ = gptq_quantize_weight(w, h, QuantizeOptions(group_size=gs, desc_act=act))
    g_idx = packed.g_idx
    assert g_idx is not None and g_idx.dtype == torch.int32
    if gs is None:
        assert bool((g_idx == 0).all())
        return
    if not act:
        assert torch.equal(g_idx, torch.arange(K, dtype=torch.int32) // gs)
        return
    # Act-order: column k joins the group of the position where it was quantized.
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    assert torch.equal(g_idx[order], torch.arange(K, dtype=torch.int32) // gs)
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((K // gs,), gs))
    assert g_idx[:4].tolist() == [0, 0, 0, 0]  # the outlier channels come first


@pytest.mark.parametrize(("gs", "act"), [(32, False), (64, True), (96, False), (None, True)])
def test_lazy_blocks_match_unblocked_reference(layer, gs: int | None, act: bool) -> None:
    w, _, h = layer
    opts = QuantizeOptions(group_size=gs, sym=False, desc_act=act)
    packed, _ = gptq_quantize_weight(w, h, opts)
    q = unpack_rows(packed.qweight).t()  # [N, K]
    same = (q == reference_gptq(w, h, opts)).float().mean()
    assert same > 0.999  # only float rounding order differs between the two


def test_rtn_is_nearest_grid_point(layer) -> None:
    w, _, _ = layer
    packed, deq = rtn_quantize_weight(w, QuantizeOptions(group_size=32, sym=False))
    scales = packed.scales.float()[(torch.arange(K) // 32)].t()
    assert bool(((w - deq).abs() <= scales / 2 + 1e-6).all())


def test_fused_rows_equal_separate(layer) -> None:
    w, _, h = layer
    opts = QuantizeOptions(group_size=32, desc_act=True)
    _, fused = gptq_quantize_weight(w, h, opts)
    parts = [gptq_quantize_weight(part, h, opts)[1] for part in w.split([40, 24])]
    assert torch.equal(torch.cat(parts), fused)


def test_dead_inputs_get_zero_weight(layer) -> None:
    w, _, h = layer
    h = h.clone()
    h[5, :], h[:, 5] = 0.0, 0.0
    for sym in (True, False):
        _, deq = gptq_quantize_weight(w, h, QuantizeOptions(group_size=32, sym=sym))
        assert bool((deq[:, 5] == 0).all())


def test_singular_hessian_gets_more_damping() -> None:
    x = torch.randn(8, 64)  # rank 8 < K = 64
    w = torch.randn(16, 64)
    packed, deq = gptq_quantize_weight(w, 2 * x.t() @ x / 8, QuantizeOptions(damp_percent=1e-9))
    assert bool(torch.isfinite(deq).all()) and packed.out_features == 16
    with pytest.raises(ConfigError, match="not positive definite"):
        gptq_quantize_weight(w, torch.full((64, 64), float("nan")), QuantizeOptions())


# --- calibration ----------------------------------------------------------------------------


def test_sample_windows_are_seeded_slices() -> None:
    ids = list(range(1000))
    a = calibration.sample_windows(ids, 6, 50, seed=3)
    assert a.shape == (6, 50) and a.dtype == torch.int64
    assert torch.equal(a, calibration.sample_windows(ids, 6, 50, seed=3))
    assert not torch.equal(a, calibration.sample_windows(ids, 6, 50, seed=4))
    assert bool((a[:, 1:] - a[:, :-1] == 1).all())  # consecutive tokens
    with pytest.raises(ConfigError, match="fewer than seq_len=2000"):
        calibration.sample_windows(ids, 1, 2000, seed=0)


def test_bundled_texts() -> None:
    from pagedq.eval_ppl import bundled_eval_text

    calib, held_out = calibration.bundled_calibration_text(), bundled_eval_text()
    assert 30_000 <= len(calib.encode()) <= 60_000
    assert 10_000 <= len(held_out.encode()) <= 20_000
    shared = {line for line in calib.splitlines() if len(line) > 40}
    assert not shared & set(held_out.splitlines())  # held out: no shared paragraph


def test_calibration_file(tmp_path: Path) -> None:
    from pagedq.gptq.cli import load_calibration_file

    (tmp_path / "c.txt").write_text("plain text")
    assert load_calibration_file(str(tmp_path / "c.txt")) == "plain text"
    lines = [json.dumps({"text": "one"}), "", json.dumps({"text": "two", "id": 2})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    assert load_calibration_file(str(tmp_path / "c.jsonl")) == "one\n\ntwo"
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(ConfigError, match="line 1"):
        load_calibration_file(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ConfigError, match="missing"):
        load_calibration_file(str(tmp_path / "missing.txt"))


# --- whole models ---------------------------------------------------------------------------

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A tiny Llama whose activations are correlated (low-rank embeddings, outlier channels,
    as in trained models; isotropic inputs would make GPTQ no better than RTN), plus token
    windows sampled from it: (folder, calibration [16, 48], held-out [16, 48])."""
    from transformers import LlamaForCausalLM

    from tests.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "src", hidden_size=64)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = hf.config.vocab_size, hf.config.hidden_size
    with torch.no_grad():
        low_rank = torch.randn(vocab, 4, generator=gen) @ torch.randn(4, hidden, generator=gen)
        hf.model.embed_tokens.weight.copy_(low_rank + 0.3 * torch.randn(vocab, hidden))
        for block in hf.model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight.fill_(1.0)
                norm.weight[torch.randperm(hidden, generator=gen)[:4]] = 6.0
        hf.lm_head.weight.mul_(3.0)
        hf.save_pretrained(folder)
        ids = torch.randint(3, vocab, (32, 1), generator=gen)
        for _ in range(47):  # sample from the model itself: fp has the lowest expected NLL
            probs = torch.softmax(hf(ids).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return folder, ids[:16], ids[16:]


def dequantized_model(src: Path, out: Path):
    """The dense model of `src` with every projection replaced by what `out` dequantizes to."""
    from pagedq.loader.weights import Checkpoint
    from pagedq.models.llama import load_llama

    model = load_llama(src, torch.float32)
    ckpt, gptq = Checkpoint.open(out), load_gptq_config(out)
    assert gptq is not None
    for i, block in enumerate(model.layers):
        for fused, names in FUSED.items():
            parts = [read_gptq_tensors(ckpt, f"model.layers.{i}.{n}") for n in names]
            weights = [
                dequantize(p.qweight, p.qzeros, p.scales, p.g_idx, gptq.zero_offset).t()  # type: ignore[arg-type]
                for p in parts
            ]
            block.get_submodule(fused).weight.data.copy_(torch.cat(weights))
    return model


def held_out_ppl(model, held: torch.Tensor) -> float:
    from pagedq.eval_ppl import token_perplexity

    return token_perplexity(model, held.reshape(-1).tolist(), window=held.shape[1])


@pytest.mark.parametrize(
    "kwargs",
    [{"group_size": 32}, {"group_size": 32, "sym": False}, {"group_size": None, "desc_act": True}],
    ids=["g32-sym", "g32-asym", "g-1-act"],
)
def test_gptq_model_perplexity_below_rtn(tiny, tmp_path: Path, kwargs: dict) -> None:
    from pagedq.models.llama import load_llama

    src, calib, held = tiny
    ppl = {}
    for method in ("gptq", "rtn"):
        opts = QuantizeOptions(method=method, **kwargs)
        out = Q.quantize_model(src, tmp_path / method, opts, calibration_tokens=calib)
        ppl[method] = held_out_ppl(dequantized_model(src, out), held)
    fp = held_out_ppl(load_llama(src, torch.float32), held)
    assert fp < ppl["gptq"] < ppl["rtn"], (fp, ppl)


@pytest.mark.parametrize(
    "opts",
    [
        QuantizeOptions(group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2"),
        QuantizeOptions(group_size=64, true_sequential=False),
    ],
    ids=["act-asym-v2", "g64-parallel"],
)
def test_quantized_folder(tiny, tmp_path: Path, opts: QuantizeOptions) -> None:
    from pagedq.loader.hf_config import load_model_config
    from pagedq.loader.weights import Checkpoint

    src, calib, _ = tiny
    out = Q.quantize_model(src, tmp_path / "q", opts, calibration_tokens=calib, progress=False)
    assert load_gptq_config(out) == opts.gptq_config()
    settings = json.loads((out / "quantize_config.json").read_text())
    assert settings["meta"] == {"quantizer": [f"pagedq:{pagedq.__version__}"]}
    config, ckpt = load_model_config(out), Checkpoint.open(out)
    shapes = {  # checkpoint projection -> (out, in)
        "self_attn.q_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
        "self_attn.k_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "self_attn.v_proj": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "self_attn.o_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
        "mlp.gate_proj": (config.intermediate_size, config.hidden_size),
        "mlp.up_proj": (config.intermediate_size, config.hidden_size),
        "mlp.down_proj": (config.hidden_size, config.intermediate_size),
    }
    gs = opts.group_size
    for i in range(config.num_hidden_layers):
        for name, (n, k) in shapes.items():
            prefix = f"model.layers.{i}.{name}"
            assert f"{prefix}.weight" not in ckpt
            part = read_gptq_tensors(ckpt, prefix)
            groups = 1 if gs is None else k // gs
            assert (part.out_features, part.in_features) == (n, k)
            assert part.scales.shape == (groups, n) and part.qzeros.shape == (groups, n // 8)
            assert part.g_idx is not None and part.g_idx.shape == (k,)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert ckpt.get(name).dtype == torch.float16  # fp32 source -> fp16
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def test_true_sequential_feeds_quantized_inputs(tiny, tmp_path: Path) -> None:
    from pagedq.loader.weights import Checkpoint

    src, calib, _ = tiny
    outs = {
        seq: Checkpoint.open(
            Q.quantize_model(
                src, tmp_path / str(seq), QuantizeOptions(group_size=32, true_sequential=seq),
                calibration_tokens=calib, progress=False,
            )
        )
        for seq in (True, False)
    }  # fmt: skip
    same = lambda name: torch.equal(outs[True].get(name), outs[False].get(name))
    assert same("model.layers.0.self_attn.q_proj.qweight")  # same inputs: the embeddings
    assert not same("model.layers.0.self_attn.o_proj.qweight")  # sees quantized q/k/v or not


def test_calibration_from_text_and_errors(tiny, tmp_path: Path) -> None:
    src, _, _ = tiny
    opts = QuantizeOptions(group_size=32, samples=4, seq_len=32)
    out = Q.quantize_model(src, tmp_path / "bundled", opts, progress=False)
    assert load_gptq_config(out) is not None
    with pytest.raises(ConfigError, match="not empty"):
        Q.quantize_model(src, out, opts)
    with pytest.raises(UnsupportedModelError, match="already GPTQ"):
        Q.quantize_model(out, tmp_path / "again", opts)
    with pytest.raises(ConfigError, match="fewer than seq_len=32"):
        Q.quantize_model(src, tmp_path / "short", opts, calibration_text="too short")
    with pytest.raises(ConfigError, match="vocab_size"):
        bad = torch.full((2, 8), 10_000, dtype=torch.int64)
        Q.quantize_model(src, tmp_path / "bad", opts, calibration_tokens=bad)


def test_quantized_folder_runs_in_pagedq(tiny, tmp_path: Path) -> None:
    pytest.importorskip("pagedq.gptq.linear")
    from pagedq.models.llama import load_llama

    src, calib, held = tiny
    opts = QuantizeOptions(group_size=32, desc_act=True)
    out = Q.quantize_model(src, tmp_path / "q", opts, calibration_tokens=calib, progress=False)
    expected = held_out_ppl(dequantized_model(src, out), held)
    got = held_out_ppl(load_llama(out, torch.float32), held)
    # GPTQLinear vs dense matmul of the same dequantized weights: fp32 rounding only.
    assert got == pytest.approx(expected, rel=1e-3)


def test_cli_quantize(tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedq.gptq.cli import add_quantize_parser

    src, _, _ = tiny
    parser = argparse.ArgumentParser()
    add_quantize_parser(parser.add_subparsers())
    out = tmp_path / "rtn"
    args = parser.parse_args(
        ["quantize", str(src), str(out), "--method", "rtn", "--group-size", "-1", "--asym"]
    )
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = load_gptq_config(out)
    assert cfg is not None and cfg.group_size is None and not cfg.sym
    args = parser.parse_args(["quantize", str(src), str(tmp_path / "x"), "--group-size", "0"])
    assert args.func(args) == 1
    assert "--group-size 0" in capsys.readouterr().err


def test_default_quantized_model_is_built_once(tiny, tmp_path: Path, monkeypatch) -> None:
    import pagedq.gptq.default as default
    import pagedq.loader.default_model as loader_default

    src = tiny[0]
    monkeypatch.setenv("PAGEDQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader_default, "default_model_dir", lambda: src)
    monkeypatch.setattr(
        default, "DEFAULT_OPTIONS", QuantizeOptions(group_size=32, samples=4, seq_len=32)
    )
    first = default.default_quantized_model_dir()
    assert first.parent == tmp_path / "cache" and load_gptq_config(first) is not None
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temp left over

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("quantized twice")

    monkeypatch.setattr(Q, "quantize_model", fail)
    assert default.default_quantized_model_dir() == first
    # A process that loses the race keeps the winner's folder (its own copy is removed after).
    loser = tmp_path / "cache" / ".loser"
    loser.mkdir()
    (loser / "config.json").write_text("{}")
    default._publish(loser, first)
    assert load_gptq_config(first) is not None


def test_staged_block_equals_layer_forward(tiny) -> None:
    from pagedq.models.llama import load_llama

    src, calib, _ = tiny
    model = load_llama(src, torch.float32)
    batches = Q._Batches(model.config, calib)
    seen: list[tuple[str, int]] = []
    with torch.no_grad():
        hidden = [model.embed_tokens(t) for t in batches.tokens]
        block = model.layers[0]
        staged = Q.run_staged(block, hidden, batches, lambda n, x: seen.append((n, x[0].shape[1])))
        for h, out in zip(hidden, staged, strict=True):
            positions, kv, meta = batches.setups[int(h.shape[0])]
            layer_out, stream = block(positions, h, None, kv, meta)  # the stream before its add
            torch.testing.assert_close(out, stream + layer_out, rtol=0, atol=1e-6)
    config = model.config
    attn_width = config.num_attention_heads * config.head_dim
    assert seen == [
        ("self_attn.qkv_proj", config.hidden_size),
        ("self_attn.o_proj", attn_width),
        ("mlp.gate_up_proj", config.hidden_size),
        ("mlp.down_proj", config.intermediate_size),
    ]
