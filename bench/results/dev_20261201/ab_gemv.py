"""Dev A/B of GEMV header builds (not shipped). Usage on the H200:
    PYTHONPATH=. python3 .devp/ab_gemv.py NAME=HEADER[:SED] ... [--ms 1,8,12,16] [--reps 5]
NAME=HEAD takes the committed header; SED is a python 'old=>new' list joined by "@@"."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BIND = r'''
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <optional>
namespace pagedq {
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size);
}
TORCH_LIBRARY(NS, m) {
  m.def("gptq_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
        "Tensor(a!) workspace, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(NS, CUDA, m) { m.impl("gptq_gemv", &pagedq::gptq_gemv_cuda); }
'''


def prepare(spec: str) -> tuple[str, Path]:
    name, _, rest = spec.partition("=")
    header, _, sed = rest.partition(":")
    d = Path("/tmp/ab") / name
    d.mkdir(parents=True, exist_ok=True)
    if header == "HEAD":
        text = subprocess.run(["git", "show", "HEAD:cuda_ext/gptq_gemv.cuh"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    else:
        text = (ROOT / header).read_text()
    for pair in filter(None, sed.split("@@")):
        old, new = pair.split("=>")
        assert old in text, (name, old)
        text = text.replace(old, new)
    (d / "gptq_gemv.cuh").write_text(text)
    for f in ("gptq_gemv.cu", "gptq_host.h"):
        (d / f).write_text((ROOT / "cuda_ext" / f).read_text())
    (d / "bind.cpp").write_text(BIND.replace("NS", f"pqv_{name}"))
    return name, d


def build(name: str, d: Path) -> None:
    from torch.utils import cpp_extension
    cpp_extension.load(name=f"pqv_{name}", sources=[str(d / "gptq_gemv.cu"), str(d / "bind.cpp")],
                       extra_cflags=["-O3"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       build_directory=str(d), is_python_module=False, verbose=False)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=") for a in sys.argv[1:] if a.startswith("--"))
    ms = [int(v) for v in opts.get("ms", "1,8,12,16").split(",")]
    reps = int(opts.get("reps", "5"))
    variants = [prepare(s) for s in args]
    if os.environ.get("AB_BUILD"):
        name = os.environ["AB_BUILD"]
        build(name, dict(variants)[name])
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]],
                              env={**os.environ, "AB_BUILD": n, "MAX_JOBS": "4"}) for n, _ in variants]
    assert all(p.wait() == 0 for p in procs), "build failed"
    for n, d in variants:
        build(n, d)
    print(f"built {len(variants)} in {time.time() - t0:.0f} s", flush=True)

    from bench.gptq_stacks import SHAPES, graphed, pagedq_stack, pagedq_weights, time_ms
    from pagedq.ops import gptq as ops
    from pagedq.ops.gptq import PackedGPTQWeight
    ws = ops.cuda_workspace(torch.device("cuda"))

    def caller(n):
        op = getattr(torch.ops, f"pqv_{n}").gptq_gemv
        return lambda x, w, bias=None: op(x, w.qweight, w.scales, w.zeros, bias, ws, w.group_size)

    # --- correctness
    torch.manual_seed(0)
    bad = 0
    cases = 0
    for dtype in (torch.float16, torch.bfloat16):
        for k, n in ((4096, 4096), (11008, 4096), (4160, 1032), (256, 72)):
            for group in (128, 64):
                for zeros in (False, True):
                    groups = -(-k // group)
                    w = PackedGPTQWeight(
                        qweight=torch.randint(-(2**31), 2**31 - 1, (-(-k // 128) * 16, n),
                                              dtype=torch.int32, device="cuda"),
                        scales=(torch.rand(groups, n, device="cuda") * 0.01 + 0.001).to(dtype),
                        zeros=torch.randint(0, 16, (groups, n), device="cuda").to(dtype) if zeros else None,
                        perm=None, locks=torch.zeros(max(n // 16, ops.MIN_LOCKS), dtype=torch.int32, device="cuda"),
                        in_features=k, out_features=n, group_size=group)
                    for m in (1, 2, 5, 8, 9, 12, 16):
                        x = torch.randn(m, k, device="cuda", dtype=dtype)
                        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
                        ref = ops.gptq_matmul_reference(x, w, bias).float()
                        for vn, _ in variants:
                            c = caller(vn)
                            a = c(x, w, bias); b = c(x, w, bias)
                            torch.cuda.synchronize()
                            err = float(((a.float() - ref).abs().max() / ref.abs().max()).item())
                            same = torch.equal(a, b)
                            empty = bool((ws == -1).all().item())
                            cases += 1
                            if err > 2e-2 or not same or not empty:
                                bad += 1
                                print("BAD", vn, dtype, k, n, group, zeros, m, err, same, empty)
    print(f"check: {cases} cases, {bad} bad", flush=True)
    if bad:
        sys.exit(1)

    # --- timing: the bench stack, plus per-shape launches
    weights = pagedq_weights()
    stacks = {(vn, m): graphed(pagedq_stack(weights, m, caller(vn))) for vn, _ in variants for m in ms}
    shape_ws = {s: [w for i, w in enumerate(weights) if i % 4 == j] for j, (s, _, _) in enumerate(SHAPES)}
    shapes = {(vn, m, s): graphed(pagedq_stack(shape_ws[s], m, caller(vn)))
              for vn, _ in variants for m in ms for s in shape_ws}
    res: dict = {}
    for _ in range(reps):
        for key, fn in stacks.items():
            res.setdefault(key, []).append(time_ms(fn, 20))
        for key, fn in shapes.items():
            res.setdefault(key, []).append(time_ms(fn, 20) * 1000 / 32)
    print("\nstack ms (median of rep medians) | per-launch µs qkv / o / gate_up / down")
    for m in ms:
        for vn, _ in variants:
            st = statistics.median(res[(vn, m)])
            per = " / ".join(f"{statistics.median(res[(vn, m, s)]):.1f}" for s in shape_ws)
            spread = max(res[(vn, m)]) - min(res[(vn, m)])
            print(f"M={m:<3} {vn:<8} {st:.3f} (±{spread:.3f})  {per}")


if __name__ == "__main__":
    main()
