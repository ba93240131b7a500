"""Perplexity with pagedq's model against transformers on a tiny random Llama."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from pagedq.errors import ConfigError
from pagedq.eval_ppl import perplexity, token_perplexity

TEXT = "The ferry crossed the river twice a day, and the ferryman counted every child. " * 6


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """(folder, pagedq model, transformers model) of one tiny random Llama, fp32."""
    from transformers import LlamaForCausalLM

    from pagedq.models.llama import load_llama
    from tests.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("ppl") / "m")
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, load_llama(folder, torch.float32), hf


def hf_nll(hf, ids: list[int], begin: int, end: int, first: int) -> float:
    """Summed NLL of ids[first:end] given ids[begin:...] as the only context (transformers)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids[begin:end]])).logits[0].float()  # [end - begin, V]
    targets = torch.tensor(ids[first:end])
    rows = logits[first - begin - 1 : end - begin - 1]
    return float(torch.nn.functional.cross_entropy(rows, targets, reduction="sum"))


def ids_of(n: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_single_window_matches_transformers(tiny) -> None:
    _, model, hf = tiny
    ids = ids_of(40)
    expected = math.exp(hf_nll(hf, ids, 0, 40, 1) / 39)
    assert token_perplexity(model, ids, window=64) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    ("window", "stride", "windows"),
    [
        # disjoint: a window's first token has no context and is not scored
        (16, None, [(0, 16, 1), (16, 32, 17), (32, 40, 33)]),
        # overlapping: each window scores only the tokens past the previous window's end
        (16, 8, [(0, 16, 1), (8, 24, 16), (16, 32, 24), (24, 40, 32)]),
        (30, 20, [(0, 30, 1), (20, 40, 30)]),
    ],
)
def test_windows(tiny, window: int, stride: int | None, windows: list[tuple[int, int, int]]):
    _, model, hf = tiny
    ids = ids_of(40)
    nll = sum(hf_nll(hf, ids, b, e, f) for b, e, f in windows)
    scored = sum(e - f for _, e, f in windows)
    got = token_perplexity(model, ids, window=window, stride=stride)
    assert got == pytest.approx(math.exp(nll / scored), rel=1e-4)


def test_perplexity_of_folder_and_text(tiny) -> None:
    from transformers import AutoTokenizer

    folder, _, hf = tiny
    ids = AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"][:50]
    expected = math.exp(hf_nll(hf, ids, 0, 50, 1) / 49)
    got = perplexity(folder, TEXT, window=128, max_tokens=50)
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "n", "match"),
    [
        ({"window": 1}, 10, "window=1"),
        ({"window": 8, "stride": 0}, 10, "stride=0"),
        ({"window": 8, "stride": 9}, 10, "stride=9"),
        ({}, 1, "1 tokens"),
    ],
)
def test_errors(tiny, kwargs: dict, n: int, match: str) -> None:
    _, model, _ = tiny
    with pytest.raises(ConfigError, match=match):
        token_perplexity(model, ids_of(n), **kwargs)


def test_max_tokens_error(tiny) -> None:
    with pytest.raises(ConfigError, match="max_tokens=1"):
        perplexity(tiny[0], TEXT, max_tokens=1)


def test_cli_eval_ppl(tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedq.gptq.cli import add_eval_ppl_parser

    folder = tiny[0]
    parser = argparse.ArgumentParser()
    add_eval_ppl_parser(parser.add_subparsers())
    (tmp_path / "t.txt").write_text(TEXT)
    args = parser.parse_args(
        ["eval-ppl", str(folder), "--text", str(tmp_path / "t.txt"), "--max-tokens", "50"]
    )
    assert args.func(args) == 0
    printed = float(capsys.readouterr().out.split()[-1])
    assert printed == pytest.approx(perplexity(folder, TEXT, max_tokens=50), abs=1e-4)
    args = parser.parse_args(["eval-ppl", str(folder), "--max-tokens", "64", "--window", "32"])
    assert args.func(args) == 0  # the bundled held-out text
    args = parser.parse_args(["eval-ppl", str(folder), "--text", str(tmp_path / "none.txt")])
    assert args.func(args) == 1
    assert "none.txt" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_perplexity_on_gpu_matches_cpu(tiny, tmp_path: Path) -> None:
    from pagedq.gptq.quantizer import QuantizeOptions, quantize_model

    folder = tiny[0]
    kwargs = {"window": 32, "max_tokens": 60}
    cpu = perplexity(folder, TEXT, **kwargs)
    assert perplexity(folder, TEXT, device="cuda", **kwargs) == pytest.approx(cpu, rel=1e-3)
    opts = QuantizeOptions(group_size=32, desc_act=True, samples=4, seq_len=32)
    quantized = quantize_model(folder, tmp_path / "q", opts, progress=False)
    cpu = perplexity(quantized, TEXT, **kwargs)
    gpu = perplexity(quantized, TEXT, device="cuda", dtype=torch.float16, **kwargs)
    assert gpu == pytest.approx(cpu, rel=2e-2)  # fp16 activations on the GPU vs fp32 on the CPU
