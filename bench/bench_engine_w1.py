"""W1: an offline batch sharing one long system prompt, CUDA-graph steps vs eager steps.

Conditions (targets.md W1): the synthetic Llama-2-7B GPTQ model of bench_engine_decode.py;
128 prompts of one 1,024-token system prompt plus 64 tokens of their own, 64 new tokens
each, greedy, EOS ignored, all 128 in one batch (`max_num_seqs` 128), prefix caching on.
Every timed run draws a new system prompt and new own tokens, so its prefix is computed once
in the run and nothing is served from an earlier run's cache. Each mode runs once untimed
(kernels compile, graphs are captured), then --repeats timed runs; new tokens/s = 128 * 64 /
the median wall time of `LLM.generate`. The modes are bench_engine_decode's `MODES`: graphs with
launch-ahead (the default engine), graphs one step at a time, and eager steps (the same engine
with its graphs detached).

Run (about 1 minute on an H200, plus about 1 minute to write the model the first time):
    PYTHONPATH=. python3 bench/bench_engine_w1.py --out bench/results
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.bench_engine_decode import (
    MODES,
    VOCAB,
    command_line,
    engine_bench_args,
    environment,
    markdown_table,
    save_result,
    set_mode,
    write_model,
)
from pagedq import LLM, SamplingParams

PROMPTS, SYSTEM_TOKENS, OWN_TOKENS, NEW_TOKENS = 128, 1024, 64, 64
TARGET_SECONDS = 0.8  # targets.md W1: <= 0.8 s, >= 10,000 new tokens/s


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, VOCAB, (SYSTEM_TOKENS,), generator=g).tolist()
    own = torch.randint(3, VOCAB, (PROMPTS, OWN_TOKENS), generator=g).tolist()
    return [system + row for row in own]


def timed_runs(llm: LLM, repeats: int, seed: int) -> tuple[float, dict[str, Any]]:
    """Median seconds of `generate` over fresh prompts (seeds seed, seed + 1, ...), and the
    last run's counters."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    times = []
    counters: dict[str, Any] = {}
    for run in range(repeats + 1):
        batch = prompts(seed + run)
        before = llm.stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize()
        if run:  # the first run is untimed
            times.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
        after = llm.stats()
        keys = ("prefix_queried_tokens", "prefix_hit_tokens", "graph_steps")
        counters = {k: int(after[k]) - int(before[k]) for k in keys}
    return statistics.median(times), counters


def main() -> None:
    args = engine_bench_args(__doc__ or "")
    folder = write_model(args.work)
    llm = LLM(str(folder), device="cuda", num_blocks=4096, max_num_seqs=PROMPTS)
    graphs = llm.engine.runner.graphs
    rows = []
    for i, mode in enumerate(MODES):
        set_mode(llm, graphs, mode)
        seconds, counters = timed_runs(llm, args.repeats, seed=1000 * i)
        rows.append({"mode": mode, "seconds": seconds,
                     "tokens_per_s": PROMPTS * NEW_TOKENS / seconds, **counters})  # fmt: skip
        print(f"  {mode}: {seconds:.3f} s, {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
    set_mode(llm, graphs, "graphs")
    env = environment(llm)
    lines = [
        f"# W1 shared-system-prompt batch, {env['gpu']}, torch {env['torch']}, "
        f"triton {env['triton']}, {env['date_utc']} UTC",
        "",
        f"Command: `{command_line()}`",
        "",
    ]
    header = ["steps", "seconds", "new tokens/s", "prompt tokens hit / queried", "graph steps"]
    lines += markdown_table(
        [*header, "target"],
        (
            [r["mode"], f"{r['seconds']:.3f}", f"{r['tokens_per_s']:.0f}",
             f"{r['prefix_hit_tokens']} / {r['prefix_queried_tokens']}", r["graph_steps"],
             f"<= {TARGET_SECONDS} s"]
            for r in rows
        ),
    )  # fmt: skip
    save_result(args.out, "engine_w1", env, rows, lines)


if __name__ == "__main__":
    main()
