"""The cost of prefix caching when nothing hits: the same workload with caching on and off.

Target (targets.md, "Overheads that must stay small"): prefix caching on a workload with 0%
hits is < 1% slower than with caching off.

Conditions: the synthetic Llama-2-7B GPTQ model of bench_engine_decode.py (`--small`: a
one-layer fp16 model with hidden 64, for a check on a CPU). Two engines in one process, the
same except `enable_prefix_caching`, with the default engine settings (CUDA graphs with
launch-ahead on a GPU). Two cases, each batch in one `generate` call, greedy, EOS ignored:
- prefill: 64 prompts of 1,024 random tokens, 16 new tokens each (every full prompt block is
  hashed and registered, none is hit);
- decode: 64 prompts of 8 random tokens, 128 new tokens each (W2 at B=64: a block fills every
  16 steps).
Every run draws new prompts, so the caching engine never hits: earlier runs' blocks stay
cached and are evicted as the pool runs out, as in a long job without hits. Each engine runs
each case once untimed, then --repeats rounds alternate the two engines on the same prompts;
reported: the median wall time of each, and caching-on over caching-off.

Run (about 3 minutes on an H200, plus about 1 minute to write the model the first time):
    PYTHONPATH=. python3 bench/bench_prefix_overhead.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_engine_decode import (
    VOCAB,
    command_line,
    markdown_table,
    save_result,
    write_model,
)
from pagedq import LLM, SamplingParams

BATCH = 64
CASES = {"prefill": (1024, 16), "decode": (8, 128)}  # name -> (prompt tokens, new tokens)
TARGET = 1.01  # caching on / caching off


def run_once(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall seconds of one `generate` of `prompts`, the device synchronised around it."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return seconds


def measure(
    engines: dict[bool, LLM], prompt_tokens: int, new_tokens: int, repeats: int, seed: int
) -> dict[str, Any]:
    """Median seconds per engine (key: caching on) over `repeats` alternated rounds."""
    g = torch.Generator().manual_seed(seed)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rnd in range(repeats + 1):
        prompts = torch.randint(3, VOCAB, (BATCH, prompt_tokens), generator=g).tolist()
        order = (True, False) if rnd % 2 else (False, True)
        for caching in order:
            seconds = run_once(engines[caching], prompts, new_tokens)
            if rnd:  # the first round is untimed
                times[caching].append(seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    hits = engines[True].stats()["prefix_hit_tokens"]
    return {"on": on, "off": off, "ratio": on / off, "hit_tokens": hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedq-llama2-7b-gptq"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="a one-layer fp16 model (CPU check)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        folder = write_model(
            args.work, layers=1, hidden=64, inter=128, heads=2, gptq=False, device="cpu"
        )
    else:
        folder = write_model(args.work)
    blocks = BATCH * -(-(max(p + n for p, n in CASES.values())) // 16) + 64
    engines = {
        caching: LLM(
            str(folder),
            device=device,
            num_blocks=blocks,
            max_num_seqs=BATCH,
            enable_prefix_caching=caching,
        )
        for caching in (True, False)
    }
    rows = []
    for i, (name, (prompt_tokens, new_tokens)) in enumerate(CASES.items()):
        row = {"case": name, **measure(engines, prompt_tokens, new_tokens, args.repeats, i)}
        rows.append(row)
        print(f"  {name}: on / off = {row['ratio']:.4f}", flush=True)
    write(rows, args, device)


def write(rows: list[dict[str, Any]], args: argparse.Namespace, device: str) -> None:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    env = {"date_utc": stamp, "device": name, "torch": torch.__version__,
           "python": platform.python_version(), "small": args.small}  # fmt: skip
    model = "one-layer fp16 check model" if args.small else "Llama-2-7B-shaped GPTQ model"
    lines = [
        f"# Prefix caching with 0% hits, {name}, torch {env['torch']}, {stamp} UTC",
        "",
        f"Command: `{command_line()}`; {model}, batch {BATCH}, median of "
        f"{args.repeats} alternated rounds.",
        "",
    ]
    lines += markdown_table(
        ["case", "caching on (s)", "caching off (s)", "on / off", "hit tokens", "target"],
        (
            [r["case"], f"{r['on']:.4f}", f"{r['off']:.4f}", f"{r['ratio']:.4f}",
             r["hit_tokens"], f"< {TARGET}"]
            for r in rows
        ),
    )  # fmt: skip
    save_result(args.out, "prefix_overhead", env, rows, lines)


if __name__ == "__main__":
    main()
