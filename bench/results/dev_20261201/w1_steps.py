"""Dev: per-step host timings of W1 (graphs) with launch-ahead on / off."""
import statistics, sys, time
from pathlib import Path
sys.path.insert(0, ".")
import torch
from bench.bench_engine_decode import write_model
from bench.bench_engine_w1 import PROMPTS, prompts
from pagedq import LLM, SamplingParams

folder = write_model(Path(sys.argv[1]))
llm = LLM(str(folder), device="cuda", num_blocks=4096, max_num_seqs=PROMPTS)
eng = llm.engine
T: dict[str, list[float]] = {}

def timed(obj, name, key):
    fn = getattr(obj, name)
    def wrap(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); T.setdefault(key, []).append(time.perf_counter() - t); return r
    setattr(obj, name, wrap)

timed(eng, "step", "step")
timed(eng.sampler.__class__, "__call__", "sampler") if False else None
sam = eng.sampler
class S:
    def __call__(self, *a, **k):
        t = time.perf_counter(); r = sam(*a, **k); T.setdefault("sampler", []).append(time.perf_counter() - t); return r
eng.sampler = S()
timed(eng.scheduler, "schedule", "schedule")
timed(eng.runner, "execute", "execute")
timed(eng, "_decode_text", "detok")
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
for rep in range(3):
    for ahead in (True, False):
        eng.launch_ahead = ahead
        batch = prompts(9000 + 10 * rep + ahead)
        T.clear()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        torch.cuda.synchronize(); wall = time.perf_counter() - t0
        med = {k: statistics.median(v[3:]) * 1e3 for k, v in T.items()}
        tot = {k: sum(v) * 1e3 for k, v in T.items()}
        print(f"rep {rep} ahead={ahead}: {wall:.3f} s | median ms " + " ".join(f"{k}={v:.2f}" for k, v in med.items())
              + " | total ms " + " ".join(f"{k}={v:.0f}" for k, v in tot.items()) + f" | steps {len(T['step'])}", flush=True)
