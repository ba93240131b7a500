"""End to end against Hugging Face transformers: greedy tokens and top-5 log-probs agree.

Random tiny Llamas of several shapes (GQA 3:1 and 4:1, head_dim 64, llama3 RoPE scaling, tied
and untied embeddings) are written by transformers and read by pagedq.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.outputs import RequestOutput
from tests.tiny_models import hf_greedy, hf_model, make_tiny_llama

STEPS = 32
SHAPES = {
    "gqa2": {},
    "gqa3-9x3-tied": {
        "num_heads": 9,
        "num_kv_heads": 3,
        "hidden_size": 72,
        "tie_word_embeddings": True,
    },
    "gqa4-hd64": {"num_heads": 8, "num_kv_heads": 2, "hidden_size": 128, "head_dim": 64},
    "llama3-rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "mha-explicit-hd": {"num_heads": 2, "num_kv_heads": 2, "head_dim": 48, "hidden_size": 64},
}


def ragged_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 5, 16, 17, 40, 3]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_agrees(
    ours: list[int],
    ours_lp: list[dict[int, float]],
    ref: list[int],
    ref_lp: list[torch.Tensor],
    tol: float = 2e-3,
) -> None:
    """Equal greedy tokens; where they first differ, each side's pick is in the other's top-5
    (fp32 on both sides, but different op orders can flip near-ties); log-probs close before,
    within `tol` (the default suits fp32 on both sides)."""
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        ref_top = torch.topk(ref_lp[step], 5)
        if a != b:
            assert a in ref_top.indices.tolist() and b in ours_lp[step], (step, a, b)
            return
        for tok, lp in zip(ref_top.indices.tolist(), ref_top.values.tolist(), strict=True):
            # the same dtype end to end: differences come from summation order only
            assert ours_lp[step][tok] == pytest.approx(lp, abs=tol), (step, tok)


def assert_outputs_agree(
    got: list[RequestOutput], expected: list[RequestOutput], vocab: int, tol: float = 2e-3
) -> None:
    """`assert_agrees` on the first completion of each request of two pagedq runs (both with
    top-k logprobs); the expected side's entries become dense [vocab] rows."""
    for a, b in zip(got, expected, strict=True):
        ref = []
        for entry in b.outputs[0].logprobs or []:
            dense = torch.full((vocab,), -1e9)
            for tok, lp in entry.items():
                dense[tok] = lp
            ref.append(dense)
        out = a.outputs[0]
        assert out.logprobs is not None
        assert_agrees(out.token_ids, out.logprobs, b.outputs[0].token_ids, ref, tol)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_and_logprobs_match_transformers(tmp_path: Path, shape: str) -> None:
    folder = make_tiny_llama(tmp_path / shape, **SHAPES[shape])
    prompts = ragged_prompts(384)
    llm = LLM(str(folder), dtype="float32", device="cpu", num_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(folder)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, ref_lp = hf_greedy(hf, prompt, STEPS)
        got = out.outputs[0]
        assert got.logprobs is not None and len(got.token_ids) == STEPS
        assert_agrees(got.token_ids, got.logprobs, ref, ref_lp)
