"""Host time of a decode step at batch 256: scheduler, block manager and sampler (targets.md,
"Overheads that must stay small": < 1 ms per step).

Conditions: a one-layer fp16 Llama (hidden 64) with a 32,000-token vocabulary
(bench_engine_decode's `write_model`), written once into --work. The engine's forward is
replaced by a stub that returns fixed fp32 logits on the device, so a step is its host work
plus the sampler's kernels. 256 prompts of 8 random tokens, 128 new tokens each, EOS ignored,
all in one batch; steps run one at a time (launch-ahead off, so nothing hides the host). Two
sampling settings: greedy, and temperature 0.8 with top-p 0.9 (seeded; --sampling greedy
skips it). One untimed run, then --repeats timed runs of `LLM.generate`.

Reported per decode step (the run's wall time over its 129 steps, the prefill step included):
the wall time, and the time inside `Scheduler.schedule` + `commit` (the block manager's
allocation and hashing included), inside the sampler on the host (`Sampler.launch`: its
stages and kernel launches; and `PendingSample.result` once the tokens have landed: the
conversion to Python values), the sampler's device wait (until the copy of the tokens has
landed: its kernels' run time, which is not host work), and the rest (the engine's appends,
stop checks and outputs). The target counts the scheduler and the sampler's host time. On a
CPU device the sampler's kernels are its math, so its host time includes them.

Run (about a minute on the H200; on a CPU, top-p takes minutes):
    PYTHONPATH=. python3 bench/bench_host.py --out bench/results [--device cpu --sampling greedy]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
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

BATCH, PROMPT_TOKENS, NEW_TOKENS = 256, 8, 128
TARGET_MS = 1.0
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
    "top-p 0.9, T 0.8": SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, seed=0
    ),
}


class Clock:
    """Seconds spent inside wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


def instrumented_llm(folder: Path, device: str) -> tuple[LLM, Clock]:
    """The engine with its forward stubbed out and its host stages timed."""
    llm = LLM(str(folder), device=device, max_num_seqs=BATCH, num_blocks=4096, launch_ahead=False)
    engine, clock = llm.engine, Clock()
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0))
    logits = logits.to(device)

    def forward(out: Any, previous: Any = None) -> torch.Tensor:
        return logits[: sum(1 for c in out.chunks if c.samples)]

    engine.runner.execute = forward  # type: ignore[method-assign]
    scheduler = engine.scheduler
    scheduler.schedule = clock.wrap("scheduler", scheduler.schedule)  # type: ignore[method-assign]
    scheduler.commit = clock.wrap("scheduler", scheduler.commit)  # type: ignore[method-assign]
    launch = clock.wrap("sampler", engine.sampler.launch)

    def sample(logits: torch.Tensor, rows: Any) -> Any:
        pending = launch(logits, rows)
        clock.wrap("sampler wait", pending.wait)()  # the device's part (CUDA), on its own
        return clock.wrap("sampler", pending.result)()

    engine.sampler = sample  # type: ignore[assignment]
    return llm, clock


def measure(llm: LLM, clock: Clock, params: SamplingParams, repeats: int) -> dict[str, float]:
    """Median ms per step of the wall time and of each stage, over the timed runs."""
    g = torch.Generator().manual_seed(1)
    steps = NEW_TOKENS + 1
    runs: dict[str, list[float]] = defaultdict(list)
    for run in range(repeats + 1):
        prompts = torch.randint(3, VOCAB, (BATCH, PROMPT_TOKENS), generator=g).tolist()
        clock.seconds.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
        if run:  # the first run is untimed
            staged = sum(clock.seconds.values())
            runs["wall"].append(wall / steps * 1e3)
            for name in ("scheduler", "sampler", "sampler wait"):
                runs[name].append(clock.seconds[name] / steps * 1e3)
            runs["rest"].append((wall - staged) / steps * 1e3)
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedq-host-bench-model"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampling", choices=["all", "greedy"], default="all")
    args = parser.parse_args()
    folder = write_model(
        args.work, layers=1, hidden=64, inter=128, heads=2, gptq=False, device="cpu"
    )
    llm, clock = instrumented_llm(folder, args.device)
    rows = []
    for name, params in SETTINGS.items():
        if args.sampling == "greedy" and params.temperature > 0:
            continue
        row = {"sampling": name, **measure(llm, clock, params, args.repeats)}
        rows.append(row)
        print(f"  {name}: {row['wall']:.3f} ms per step", flush=True)
    write(rows, args)


def cpu_name() -> str:
    """The host CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    where = f"host CPU {cpu_name()}, {os.cpu_count()} threads"
    if args.device.startswith("cuda"):
        where = f"{torch.cuda.get_device_name()}, {where}"
    env = {"date_utc": stamp, "device": args.device, "name": where, "torch": torch.__version__,
           "python": platform.python_version()}  # fmt: skip
    lines = [
        f"# Host time per decode step, batch {BATCH}, device {args.device}: {where}, "
        f"torch {env['torch']}, Python {env['python']}, {stamp} UTC",
        "",
        f"Command: `{command_line()}`",
        "",
        "ms per step (median of the timed runs):",
        "",
    ]
    header = [
        "sampling",
        "wall",
        "scheduler + block manager",
        "sampler (host)",
        "scheduler + sampler",
        "target",
        "sampler's device wait",
        "rest of the engine",
    ]
    lines += markdown_table(
        header,
        (
            [r["sampling"], f"{r['wall']:.3f}", f"{r['scheduler']:.3f}", f"{r['sampler']:.3f}",
             f"{r['scheduler'] + r['sampler']:.3f}", f"< {TARGET_MS}",
             f"{r['sampler wait']:.3f}", f"{r['rest']:.3f}"]
            for r in rows
        ),
    )  # fmt: skip
    save_result(args.out, "host", env, rows, lines)


if __name__ == "__main__":
    main()
