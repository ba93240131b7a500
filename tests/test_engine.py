"""Engine behaviour on a tiny random model: cache modes agree, small pools finish everything,
forks share blocks, stops, streaming, aborts and typed errors."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
import torch

from pagedq import LLM, SamplingParams
from pagedq.engine.llm_engine import Engine
from pagedq.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    InvalidTokenIdError,
    ModelNotFoundError,
    PromptTooLongError,
)
from pagedq.loader.tokenizer import IncrementalDetokenizer
from tests.tiny_models import make_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny"), num_heads=6, num_kv_heads=2, hidden_size=48
    )


def shared_prefix_prompts(n: int, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 384, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 384, (1 + i % 7,), generator=g).tolist() for i in range(n)]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 32])
def test_cache_modes_give_the_same_greedy_tokens(tiny: Path, batch: int) -> None:
    prompts = shared_prefix_prompts(batch)
    results = {}
    for name, kwargs in {
        "prefix": {"cache": "paged", "enable_prefix_caching": True},
        "no-prefix": {"cache": "paged", "enable_prefix_caching": False},
        "static": {"cache": "static", "max_model_len": 64},
    }.items():
        llm = LLM(str(tiny), device="cpu", num_blocks=256, **kwargs)
        results[name] = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        if name == "prefix" and batch > 1:
            assert llm.stats()["prefix_hit_tokens"] >= (batch - 1) * 32
    assert results["prefix"] == results["no-prefix"] == results["static"]


def test_tiny_pool_preempts_and_finishes_everything_identically(tiny: Path) -> None:
    prompts = shared_prefix_prompts(64, prefix_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    free = LLM(str(tiny), device="cpu", num_blocks=512)
    expected = tokens(free.generate(prompts, params, use_tqdm=False))
    # ~3 sequences of up to 47 tokens fit in 9 blocks of 16.
    tight = LLM(str(tiny), device="cpu", num_blocks=9, max_model_len=48)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == expected
    assert tight.stats()["preemptions"] > 0


def test_prefix_hits_are_reported_per_request(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=128)
    prompts = shared_prefix_prompts(3, prefix_len=48)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [48, 48]


def test_n_greater_than_one_shares_prompt_blocks(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=128)
    prompt = shared_prefix_prompts(1, prefix_len=37)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Seeded: the same again, and completion 0 equals an n=1 run with the same seed.
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    single = llm.generate([prompt], SamplingParams(seed=7, max_tokens=8, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("cache", ["paged", "static"])
def test_forks_respect_max_num_seqs(tiny: Path, cache: str) -> None:
    """n=4 with room for 2 sequences: forks without room wait (and recompute from the prefix
    cache); at most 2 run after any step, and the seeded completions are those of a roomy run."""
    prompt = shared_prefix_prompts(1, prefix_len=37)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    roomy = LLM(str(tiny), device="cpu", num_blocks=128, cache=cache)
    expected = roomy.generate([prompt], params, use_tqdm=False)[0]
    tight = LLM(str(tiny), device="cpu", num_blocks=128, cache=cache, max_num_seqs=2)
    step, peak = tight.engine.step, [0]

    def watched_step(**kwargs: bool) -> list:  # type: ignore[type-arg]
        outs = step(**kwargs)
        peak[0] = max(peak[0], len(tight.engine.scheduler.running))
        return outs

    tight.engine.step = watched_step  # type: ignore[method-assign]
    out = tight.generate([prompt], params, use_tqdm=False)[0]
    assert peak[0] <= 2
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]


def test_a_failed_forward_leaves_the_engine_usable(tiny: Path) -> None:
    """A forward that raises (say, CUDA OOM) in the step that registers shared prefix blocks:
    the error reaches the caller, who aborts those requests; the blocks, never written, must not
    be hit by the same prompts sent again, which finish with the tokens of a clean run."""
    prompts = shared_prefix_prompts(6, prefix_len=40)
    expected = tokens(LLM(str(tiny), device="cpu", num_blocks=64).generate(prompts, GREEDY))
    llm = LLM(str(tiny), device="cpu", num_blocks=64)
    engine = llm.engine
    execute = engine.runner.execute

    def failing(out, previous=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated out of memory")

    engine.runner.execute = failing  # type: ignore[method-assign]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    engine.block_manager.check_invariants([s.block_table for s in engine.scheduler.running])
    for request_id in ids:
        assert engine.abort(request_id)
    engine.runner.execute = execute  # type: ignore[method-assign]
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_seed_is_independent_of_the_batch(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=256)
    prompts = shared_prefix_prompts(8)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(prompts[3:4], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    params = [others] * 3 + [seeded] + [others] * 4
    batched = llm.generate(prompts, params, use_tqdm=False)[3].outputs[0].token_ids
    assert alone == batched


def test_stop_token_ids_and_max_tokens(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=64)
    prompt = shared_prefix_prompts(1)[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[4]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_strings_cut_the_text(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=64)
    prompt = shared_prefix_prompts(1)[0]
    free = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]


def test_streaming_abort_and_add_while_running(tiny: Path) -> None:
    engine = LLM(str(tiny), device="cpu", num_blocks=64).engine
    prompts = shared_prefix_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request(prompts[0], params, request_id="a")
    engine.add_request(prompts[1], params, request_id="b")
    seen: dict[str, int] = {}
    for _ in range(3):
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    assert seen == {"a": 3, "b": 3}
    assert engine.abort("b")
    engine.add_request(prompts[2], params, request_id="c")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "b"
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"a", "c"}
    assert engine.block_manager.num_used_blocks == 0


def test_finished_only_steps_return_each_result_once(tiny: Path) -> None:
    engine = LLM(str(tiny), device="cpu", num_blocks=64).engine
    prompts = shared_prefix_prompts(3)
    lengths = {"a": 2, "b": 5, "c": 9}
    for (rid, n), prompt in zip(lengths.items(), prompts, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
    results = []
    while engine.has_unfinished_requests():
        results += engine.step(finished_only=True)
    assert [o.request_id for o in results] == ["a", "b", "c"]
    assert all(o.finished and len(o.outputs[0].token_ids) == lengths[o.request_id]
               for o in results)  # fmt: skip
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


# --- launch-ahead (on by default on CUDA; forced on here) -----------------------------------


def completions(outs: list) -> list[tuple]:  # type: ignore[type-arg]
    """Tokens, text and stop of every completion, and its log-probs to 1e-4 (steps ahead may
    batch other rows with a sequence, which moves fp32 logits in the last bits)."""
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            [{t: pytest.approx(v, abs=1e-4) for t, v in e.items()} for e in c.logprobs or []],
            pytest.approx(c.cumulative_logprob, abs=1e-4),
        )
        for o in outs
        for c in o.outputs
    ]


@pytest.mark.parametrize(("cache", "num_blocks"), [("paged", 256), ("paged", 9), ("static", 64)])
def test_launch_ahead_gives_the_results_of_one_step_at_a_time(
    tiny: Path, cache: str, num_blocks: int
) -> None:
    """Every kind of request (greedy, seeded sampling with forks, stop strings, stop ids,
    log-probs, eos, min_tokens, a penalty: its steps sample one at a time) over a shared
    prefix, with preemption in the 9-block pool: the same completions, text included, with
    and without launch-ahead (steps scheduled before the host reads the last tokens)."""
    prompts = shared_prefix_prompts(12, prefix_len=20)
    reference = LLM(str(tiny), device="cpu", num_blocks=512).generate(prompts, GREEDY)
    text = reference[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    kinds = [
        GREEDY,
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7, 11, 13, 17]),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    got = {}
    for ahead in (False, True):
        llm = LLM(
            str(tiny),
            device="cpu",
            cache=cache,
            num_blocks=num_blocks,
            max_model_len=48,
            launch_ahead=ahead,
        )
        assert llm.engine.launch_ahead is ahead
        got[ahead] = completions(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.block_manager.num_used_blocks == 0 and llm.engine._launched is None
        if num_blocks == 9:
            assert llm.stats()["preemptions"] > 0
    assert got[True] == got[False]


def test_results_decode_their_text_once_and_match_the_stream(tiny: Path) -> None:
    """`generate` (finished-only steps) decodes a completion's text once, when it ends; the
    text is the one a stream builds token by token, and the one `decode` gives."""
    llm = LLM(str(tiny), device="cpu", num_blocks=128)
    prompts = shared_prefix_prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    calls = []
    add_many = IncrementalDetokenizer.add_many

    def counted(self: IncrementalDetokenizer, ids: list[int]) -> str:
        calls.append(len(ids))
        return add_many(self, ids)

    IncrementalDetokenizer.add_many = counted  # type: ignore[method-assign]
    try:
        results = llm.generate(prompts, params, use_tqdm=False)
    finally:
        IncrementalDetokenizer.add_many = add_many  # type: ignore[method-assign]
    assert calls == [15] * 6
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    streamed: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs[0].text.startswith(streamed.get(out.request_id, ""))
            streamed[out.request_id] = out.outputs[0].text
    for i, result in enumerate(results):
        text = result.outputs[0].text
        assert text == streamed[str(i)] == llm.tokenizer.decode(result.outputs[0].token_ids)


def test_launch_ahead_streams_aborts_and_adds(tiny: Path) -> None:
    """Streaming with a step always launched ahead: a request aborted while its next token is
    being computed never reappears, one added meanwhile joins a step later, every finished
    result comes once, and its tokens are those of a run without launch-ahead."""
    prompts = shared_prefix_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = {
        rid: o.outputs[0].token_ids
        for rid, o in zip("acd", LLM(str(tiny), device="cpu").generate(
            [prompts[0], prompts[2], prompts[3]], params, use_tqdm=False
        ), strict=True)
    }  # fmt: skip
    engine = LLM(str(tiny), device="cpu", num_blocks=64, launch_ahead=True).engine
    engine.add_request(prompts[0], params, request_id="a")
    engine.add_request(prompts[1], params, request_id="b")
    streamed: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            streamed[out.request_id] = out.outputs[0].token_ids
    assert {rid: len(ids) for rid, ids in streamed.items()} == {"a": 3, "b": 3}
    launched = engine._launched  # step 4 runs while the caller looks at step 3 ...
    assert launched is not None and launched.sample is not None  # ... its tokens on the device
    assert engine.abort("b") and not engine.abort("b")
    engine.add_request(prompts[2], params, request_id="c")
    first = engine.step()
    assert [o.request_id for o in first] == ["a"]  # "c" was not in the step launched ahead
    engine.add_request(prompts[3], params, request_id="d")
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "b"
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out.outputs[0].token_ids
    assert finished == alone
    assert engine.block_manager.num_used_blocks == 0 and engine._launched is None


def test_a_failed_launch_ahead_keeps_the_steps_results(tiny: Path) -> None:
    """The step launched ahead fails (say, CUDA OOM): the current step's outputs still come
    back, the error reaches the caller on the next step, and the engine finishes cleanly."""
    prompts = shared_prefix_prompts(3)
    expected = tokens(LLM(str(tiny), device="cpu").generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(str(tiny), device="cpu", num_blocks=64, launch_ahead=True)
    engine = llm.engine
    execute, calls = engine.runner.execute, [0]

    def failing_once(out, previous=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] in (3, 4):  # the ahead launch of step 3, then its retry in the next call
            raise RuntimeError("simulated out of memory")
        return execute(out, previous)

    engine.runner.execute = failing_once  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=str(i))
    assert all(len(o.outputs[0].token_ids) == 1 for o in engine.step())
    assert all(len(o.outputs[0].token_ids) == 2 for o in engine.step())  # launch 3 failed
    with pytest.raises(RuntimeError, match="simulated"):
        engine.step()
    engine.block_manager.check_invariants([s.block_table for s in engine.scheduler.running])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step(finished_only=True)})
    assert [done[str(i)].outputs[0].token_ids for i in range(3)] == expected


class Token(enum.IntEnum):
    SIX = 6


def test_bad_requests_raise_typed_errors_and_do_not_disturb_others(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", num_blocks=64, max_model_len=64)
    engine: Engine = llm.engine
    engine.add_request([5, 6, 7], GREEDY, request_id="good")
    with pytest.raises(PromptTooLongError, match="64"):
        engine.add_request(list(range(3, 70)), GREEDY)
    with pytest.raises(InvalidTokenIdError, match="384"):
        engine.add_request([1, 999], GREEDY)
    with pytest.raises(InvalidTokenIdError, match="token 2 is -1"):
        engine.add_request([1, 2, -1], GREEDY)
    with pytest.raises(InvalidRequestError, match="list of int"):
        engine.add_request([5, True], GREEDY)  # bools are not token ids
    with pytest.raises(InvalidRequestError, match="list of int"):
        engine.add_request([5, 6.0], GREEDY)  # type: ignore[list-item]
    engine.add_request([5, Token.SIX], GREEDY, request_id="int-subclass")  # converted to int
    with pytest.raises(DuplicateRequestError):
        engine.add_request([5], GREEDY, request_id="good")
    with pytest.raises(InvalidRequestError):
        engine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request(3.5, GREEDY)  # type: ignore[arg-type]
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["good", "int-subclass"]
    assert outs[1].prompt_token_ids == [5, 6] and type(outs[1].prompt_token_ids[1]) is int
    with pytest.raises(PromptTooLongError, match="prompt 1"):
        llm.generate([[5], list(range(3, 80))], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_config_errors(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(str(tiny), device="cpu", num_blocks=4, max_model_len=100)
    with pytest.raises(ConfigError, match="cache"):
        LLM(str(tiny), device="cpu", cache="dynamic")
    with pytest.raises(ConfigError, match="block_size"):
        LLM(str(tiny), device="cpu", block_size=3)
