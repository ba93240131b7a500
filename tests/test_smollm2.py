"""The embedded SmolLM2-135M-Instruct against transformers on the same converted folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.loader.default_model import default_model_dir
from tests.test_engine_hf import assert_agrees
from tests.tiny_models import hf_greedy, hf_model

STEPS = 32


@pytest.fixture(scope="module")
def smol() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def llm(smol: Path) -> LLM:
    return LLM(str(smol), device="cpu", dtype="float32", num_blocks=256)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a primary colour."},
    ],
    [{"role": "user", "content": "Écris un haïku sur la pluie 🌧️"}],
]


def test_chat_builds_the_templates_token_ids(smol: Path, llm: LLM) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smol)
    for conv in CONVERSATIONS:
        ours = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
        theirs = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if not isinstance(theirs, list):  # transformers 5 returns a BatchEncoding
            theirs = theirs["input_ids"]
        assert ours == list(theirs)


def test_greedy_matches_transformers(smol: Path, llm: LLM) -> None:
    prompts = [llm.tokenizer.apply_chat_template(c) for c in CONVERSATIONS]
    prompts.append(llm.tokenizer.encode("Once upon a time, in a small village by the sea,"))
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(smol)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_lp = hf_greedy(hf, prompt, STEPS)
        got = out.outputs[0]
        assert got.logprobs is not None
        assert_agrees(got.token_ids, got.logprobs, ref, ref_lp)


def test_chat_answers_sensibly(llm: LLM) -> None:
    out = llm.chat(CONVERSATIONS[0], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_default_llm_runs_without_arguments() -> None:
    torch.manual_seed(0)
    llm = LLM(device="cpu", num_blocks=64)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
