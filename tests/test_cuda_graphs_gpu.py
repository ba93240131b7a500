"""On the GPU: decode steps replayed from CUDA graphs give the tokens of eager steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.config import EngineConfig
from pagedq.engine.llm_engine import Engine
from pagedq.gptq.quantizer import QuantizeOptions, quantize_model
from pagedq.outputs import RequestOutput
from tests.test_engine_hf import assert_outputs_agree
from tests.tiny_models import make_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

VOCAB = 2048
SHAPE = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 704, "num_layers": 3,
         "num_heads": 8, "num_kv_heads": 2, "head_dim": 32}  # fmt: skip


def ragged_prompts(count: int) -> list[list[int]]:
    """Lengths 1..~600, so steps fall in the 256, 512 and 1024 context buckets."""
    g = torch.Generator().manual_seed(11)
    lengths = [1, 17, 300, 77, 600, 5, 250, 33, 129, 9, 400, 64, 2][:count]
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(
    folder: Path, prompts: list[list[int]], dtype: str, eager: bool, **engine: Any
) -> tuple[LLM, list[RequestOutput]]:
    llm = LLM(
        str(folder), device="cuda", dtype=dtype, num_blocks=512, enforce_eager=eager, **engine
    )
    # different lengths: sequences leave at different steps, so decode batches shrink
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True, logprobs=5)
        for i in range(len(prompts))
    ]
    return llm, llm.generate(prompts, params, use_tqdm=False)


def assert_same_generations(
    got: list[RequestOutput], expected: list[RequestOutput], dtype: str
) -> None:
    """Greedy tokens and log-probs of graph and eager runs agree. The two differ only in
    summation order (the graphs' attention plans a split for the context bucket, eager
    steps for the exact longest context): fp16 hidden states then move log-probs by a few
    1e-3, fp32 ones by far less."""
    tol = 2e-3 if dtype == "float32" else 3e-2
    assert_outputs_agree(got, expected, VOCAB, tol)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_decode_matches_eager_dense(tmp_path: Path, dtype: str) -> None:
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(13)
    graphed, got = run(folder, prompts, dtype, eager=False)
    eager, expected = run(folder, prompts, dtype, eager=True)
    stats = graphed.stats()
    assert stats["graph_steps"] > 0 and int(stats["cuda_graphs"]) >= 4  # several buckets
    assert eager.stats()["graph_steps"] == 0
    assert_same_generations(got, expected, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_graph_decode_over_a_shared_prefix_matches_eager(tmp_path: Path, dtype: str) -> None:
    """A system prompt shared by every sequence: graphs replay the cascade decode, with the
    shared pages rounded down to a prefix bucket (12.5 pages -> 12); eager steps take all."""
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, VOCAB, (200,), generator=g).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 41, 7)]
    graphed, got = run(folder, prompts, dtype, eager=False)
    _, expected = run(folder, prompts, dtype, eager=True)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.replays > 0
    assert {key[2] for key in graphs._graphs} == {0, 12 * 16}  # one sequence left: plain
    assert_same_generations(got, expected, dtype)


def test_static_slots_longer_than_the_context_bucket(tmp_path: Path) -> None:
    """Static slots reserve max_model_len tokens of pages; graphs read only a bucket's worth."""
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(6)  # contexts up to ~650: buckets 256 and 512 of 1024, and 1024
    static = {"cache": "static", "max_model_len": 1024, "max_num_seqs": 4}
    graphed, got = run(folder, prompts, "float32", eager=False, **static)
    _, expected = run(folder, prompts, "float32", eager=True, **static)
    assert graphed.stats()["graph_steps"] > 0
    assert_same_generations(got, expected, "float32")


def test_graph_decode_matches_eager_gptq(tmp_path: Path) -> None:
    src = make_tiny_llama(tmp_path / "src", **SHAPE)
    gptq_dir = quantize_model(
        src, tmp_path / "q", QuantizeOptions(group_size=64, method="rtn"), progress=False
    )
    prompts = ragged_prompts(13)
    graphed, got = run(gptq_dir, prompts, "float16", eager=False)
    _, expected = run(gptq_dir, prompts, "float16", eager=True)
    assert graphed.stats()["graph_steps"] > 0
    assert_same_generations(got, expected, "float16")


def test_launch_ahead_matches_one_step_at_a_time(tmp_path: Path) -> None:
    """The engine's default on CUDA schedules and launches each step before the host reads
    the previous step's tokens (the forward takes them from the device): the greedy tokens
    are those of one step at a time, the log-probs agree to fp32 rounding (a stopping row
    rides one step longer, so batches differ), and steps did run ahead."""
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(13)
    ahead_llm, ahead = run(folder, prompts, "float32", eager=False)
    assert ahead_llm.engine.launch_ahead
    _, sync = run(folder, prompts, "float32", eager=False, launch_ahead=False)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in sync]
    assert_same_generations(ahead, sync, "float32")
    assert ahead_llm.engine._launched is None
    assert ahead_llm.stats()["graph_steps"] > 0


def test_requests_joining_and_aborting_mid_run(tmp_path: Path) -> None:
    """Continuous batching: the batch changes bucket every few steps; an abort frees its rows."""
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(9)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def drive(eager: bool) -> dict[str, list[int]]:
        engine = Engine(
            EngineConfig(model=str(folder), device="cuda", dtype="float32", num_blocks=512,
                         enforce_eager=eager)
        )  # fmt: skip
        done: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        steps = 0
        while pending or engine.has_unfinished_requests():
            if pending and steps % 3 == 0:
                i, prompt = pending.pop(0)
                engine.add_request(prompt, params, request_id=f"r{i}")
            if steps == 7:
                engine.abort("r1")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
        return done

    graphed, eager = drive(eager=False), drive(eager=True)
    assert "r1" not in graphed and graphed.keys() == eager.keys()
    same = sum(graphed[k] == eager[k] for k in graphed)
    assert same >= len(graphed) - 1  # fp32: a late near-tie may flip at most one row


def test_a_failed_capture_falls_back_to_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(3)
    _, expected = run(folder, prompts, "float32", eager=True)

    class Broken:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> None:
            raise RuntimeError("capture refused (test)")

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "graph", Broken)
    with pytest.warns(RuntimeWarning, match="decode steps run eagerly"):
        llm, got = run(folder, prompts, "float32", eager=False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.enabled and graphs.replays == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_the_second_gpu(tmp_path: Path) -> None:
    """Triton launches on the current device: the engine makes it its own for every step."""
    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    prompts = ragged_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for device in ("cuda:0", "cuda:1"):
        llm = LLM(str(folder), device=device, dtype="float32", num_blocks=256)
        runs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.stats()["graph_steps"] > 0
    assert torch.cuda.current_device() == 0
    assert runs["cuda:1"] == runs["cuda:0"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_perplexity_on_the_second_gpu(tmp_path: Path) -> None:
    """Direct model forwards (eval-ppl) launch their Triton kernels on the model's device."""
    from pagedq.eval_ppl import perplexity

    folder = make_tiny_llama(tmp_path / "m", **SHAPE)
    rtn = QuantizeOptions(method="rtn")
    quantized = quantize_model(folder, tmp_path / "q", rtn, progress=False)
    text = " ".join(str(i) for i in range(300))
    ppl = {
        device: perplexity(quantized, text, device=device, dtype=torch.float16, max_tokens=256)
        for device in ("cuda:0", "cuda:1")
    }
    assert torch.cuda.current_device() == 0
    assert ppl["cuda:1"] == pytest.approx(ppl["cuda:0"], rel=1e-6)
