"""Dev: eager steps with launch-ahead on / off, alternated (W2 B=16/64, W1)."""
import sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.bench_engine_decode import timed_runs as w2_runs, write_model
from bench.bench_engine_w1 import PROMPTS, timed_runs as w1_runs
from pagedq import LLM

folder = write_model(Path(sys.argv[1]))
llm = LLM(str(folder), device="cuda", num_blocks=4096, max_num_seqs=PROMPTS)
llm.engine.runner.graphs = None
for rep in range(2):
    for ahead in (True, False):
        llm.engine.launch_ahead = ahead
        for b in (16, 64):
            s = w2_runs(llm, b, 2)
            print(f"rep {rep} ahead={ahead} W2 B={b}: {b * 128 / s:.0f} tok/s", flush=True)
        s, _ = w1_runs(llm, 1, seed=5000 + 10 * rep + 5 * ahead)
        print(f"rep {rep} ahead={ahead} W1: {s:.3f} s", flush=True)
