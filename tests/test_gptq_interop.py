"""pagedq and GPTQModel read each other's GPTQ checkpoints, checked with GPTQModel's own code.

GPTQModel is not a dependency of pagedq, so this module is skipped where it is not importable.
The benchmark machine has its wheels (`bench/gpu_run.sh peers`); on a CPU machine, install
`gptqmodel` (and `optimum` for the transformers loader) into the test environment. All
three compare weights, which must agree exactly up to fp16 rounding:
- GPTQModel's packer and its v1 export write a linear, pagedq reads it;
- GPTQModel quantizes a tiny Llama, pagedq loads and runs the folder;
- pagedq's quantizer writes a model folder, GPTQModel and transformers load it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedq.gptq.checkpoint import load_gptq_config, read_gptq_tensors
from pagedq.gptq.config import GPTQConfig, GPTQTensors
from pagedq.gptq.linear import GPTQLinear
from pagedq.gptq.quantizer import QuantizeOptions, quantize_model

os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")  # no JIT build: the Python packer
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "4")  # its default pool fails on 2 cores
gptqmodel = pytest.importorskip("gptqmodel")

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def gptqmodel_linear(
    w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, cfg: Any
) -> Any:
    """GPTQModel's torch linear packed by GPTQModel from a weight on its own grid."""
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear  # type: ignore[import-not-found]

    n, k = w_q.shape
    dense = torch.nn.Linear(k, n, bias=False)
    dense.weight.data = w_q
    lin = TorchLinear(
        bits=4,
        group_size=cfg.group_size,
        sym=cfg.sym,
        desc_act=cfg.desc_act,
        in_features=k,
        out_features=n,
        bias=False,
    )
    lin.pack(dense, scales, zeros, g_idx.to(torch.int32))
    return lin


@pytest.mark.parametrize(
    ("sym", "desc_act", "group_size", "v1"),
    [
        (False, False, 32, True),
        (False, True, 64, True),
        (True, True, 32, True),
        (False, False, 128, False),
    ],
    ids=["asym-g32-v1", "asym-act-g64-v1", "sym-act-g32-v1", "asym-g128-v2"],
)
def test_pagedq_reads_what_gptqmodel_writes(
    sym: bool, desc_act: bool, group_size: int, v1: bool
) -> None:
    from gptqmodel.quantization import QuantizeConfig  # type: ignore[import-not-found]
    from gptqmodel.utils.model import (  # type: ignore[import-not-found]
        convert_gptq_v2_to_v1_format_module,
    )

    gen = torch.Generator().manual_seed(group_size + 2 * desc_act + sym)
    k, n = 256, 64
    groups = k // group_size
    q = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.full((n, groups), 8) if sym else torch.randint(0, 16, (n, groups), generator=gen)
    if not sym:
        zeros[::3] = 0  # zeros of 0: in v1, GPTQModel's export borrows from the next nibble
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).half().float()
    rows = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
    g_idx = rows // group_size
    w_q = scales[:, g_idx] * (q - zeros[:, g_idx])  # on the grid: the packing is exact
    gm_cfg = QuantizeConfig(bits=4, group_size=group_size, sym=sym, desc_act=desc_act)
    lin = gptqmodel_linear(w_q, scales, zeros, g_idx, gm_cfg)
    if v1:
        convert_gptq_v2_to_v1_format_module(lin, gm_cfg)  # what GPTQModel saves as "gptq"
    cfg = GPTQConfig(
        bits=4,
        group_size=group_size,
        desc_act=desc_act,
        sym=sym,
        checkpoint_format="gptq" if v1 else "gptq_v2",
        quantizer=(f"gptqmodel:{gptqmodel.__version__}",),
    )
    tensors = GPTQTensors(lin.qweight, lin.qzeros, lin.scales, lin.g_idx.to(torch.int32))
    got = GPTQLinear([tensors], cfg, torch.float32).dequantized_weight()
    torch.testing.assert_close(got, w_q, rtol=0, atol=0)


def assert_same_weights(model: Any, out: Path) -> None:
    """Every projection of the loaded `model` dequantizes to what pagedq reads from `out`."""
    from pagedq.loader.weights import Checkpoint

    cfg, ckpt = load_gptq_config(out), Checkpoint.open(out)
    assert cfg is not None
    quantized = {n.removesuffix(".qweight") for n in ckpt.names() if n.endswith(".qweight")}
    compared = 0
    for name, module in model.named_modules():
        suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else ""
        if suffix not in PROJECTIONS or name not in quantized:
            continue
        part_cfg = cfg.for_module(name)
        assert part_cfg is not None
        ours = GPTQLinear([read_gptq_tensors(ckpt, name)], part_cfg, torch.float32)
        theirs = module.dequantize_weight().float()  # [K, N]: W^T, in fp16
        torch.testing.assert_close(theirs.t(), ours.dequantized_weight(), rtol=1e-3, atol=0)
        compared += 1
    assert compared == len(quantized) > 0


@pytest.mark.parametrize(
    "opts",
    [
        QuantizeOptions(group_size=32),
        QuantizeOptions(group_size=32, desc_act=True, sym=False),
        QuantizeOptions(group_size=64, sym=False, checkpoint_format="gptq_v2"),
    ],
    ids=["sym-g32-v1", "asym-act-g32-v1", "asym-g64-v2"],
)
def test_gptqmodel_and_transformers_read_what_pagedq_writes(
    tmp_path: Path, opts: QuantizeOptions
) -> None:
    from gptqmodel import BACKEND, GPTQModel  # type: ignore[import-not-found]

    from tests.tiny_models import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    calib = torch.randint(3, 384, (8, 64), generator=torch.Generator().manual_seed(0))
    out = quantize_model(src, tmp_path / "q", opts, calibration_tokens=calib, progress=False)
    # GPTQModel.load accepts asymmetric v1 only from GPTQModel itself (a policy of its loader:
    # AutoGPTQ's asymmetric v1 zeros were lossy); transformers' loader reads them.
    if opts.sym or opts.checkpoint_format == "gptq_v2":
        loaded = GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
        assert_same_weights(loaded.model, out)
    try:
        import optimum  # noqa: F401  # type: ignore[import-not-found]
        import transformers
    except ImportError:
        return  # transformers' GPTQ loader needs optimum
    model = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    assert_same_weights(model, out)


DYNAMIC = {r"-:.*\.0\.self_attn\.k_proj": {}, r"+:.*\.1\.mlp\.down_proj": {"group_size": 128}}


@pytest.mark.parametrize(
    ("sym", "desc_act", "group_size", "fmt", "dynamic"),
    [
        (False, False, 32, "gptq", None),
        (False, False, 32, "gptq_v2", None),
        (True, True, 64, "gptq", None),
        (True, False, 64, "gptq", DYNAMIC),
    ],
    ids=["asym-g32", "asym-g32-v2", "sym-act-g64", "dynamic"],
)
def test_pagedq_runs_a_model_gptqmodel_quantized(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sym: bool,
    desc_act: bool,
    group_size: int,
    fmt: str,
    dynamic: dict[str, dict[str, int]] | None,
) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig  # type: ignore[import-not-found]
    from safetensors.torch import load_file, save_file

    from pagedq import LLM, SamplingParams
    from pagedq.gptq.format import unpack_cols
    from pagedq.loader.weights import Checkpoint
    from tests.tiny_models import make_tiny_llama

    src = make_tiny_llama(tmp_path / "src", hidden_size=128, intermediate_size=256)
    weights = load_file(src / "model.safetensors")
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    q_proj[:, :group_size] = q_proj[:, :group_size].abs()  # a group with zero point 0
    save_file(weights, str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    calib = [
        {
            "input_ids": torch.randint(3, 384, (64,), generator=gen).tolist(),
            "attention_mask": [1] * 64,
        }
        for _ in range(16)
    ]
    monkeypatch.chdir(tmp_path)  # GPTQModel's quantizer writes logs/ into the working directory
    qcfg = QuantizeConfig(
        bits=4, group_size=group_size, sym=sym, desc_act=desc_act, format=fmt, dynamic=dynamic
    )
    model = GPTQModel.load(str(src), qcfg, device="cpu")
    model.quantize(calib, batch_size=4)
    model.save(str(tmp_path / "q"))
    out = tmp_path / "q"
    cfg = load_gptq_config(out)
    assert cfg is not None and cfg.checkpoint_format == fmt
    assert cfg.zeros_by_word == (fmt == "gptq")
    if not sym and fmt == "gptq":  # the borrow this reading exists for happened
        stored = unpack_cols(
            read_gptq_tensors(Checkpoint.open(out), "model.layers.0.self_attn.q_proj").qzeros
        )
        assert bool((stored == 15).any())
    if dynamic is not None:  # k_proj of layer 0 stayed dense, down_proj of layer 1 has 2 groups
        assert "model.layers.0.self_attn.k_proj.weight" in Checkpoint.open(out)
        assert cfg.for_module("model.layers.1.mlp.down_proj") == replace(
            cfg, group_size=128, dynamic=()
        )
    loaded = GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    assert_same_weights(loaded.model, out)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (done,) = LLM(str(out), device="cpu", num_blocks=32).generate([[5, 9, 33, 2, 100]], params)
    assert len(done.outputs[0].token_ids) == 8
