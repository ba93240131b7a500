"""Development check of the CUDA tensor-core GPTQ kernel: correctness grid + split sweep."""

from __future__ import annotations

import sys

import torch

from bench.bench_gptq import SHAPES, graphed, pagedq_weights, time_ms
from pagedq.ops import gptq as ops
from triton_kernels import gptq_configs


def check() -> float:
    torch.manual_seed(0)
    worst = 0.0
    for dtype in (torch.float16, torch.bfloat16):
        for k, n, gs, asym in ((4096, 4096, 128, False), (1000, 264, 32, True), (512, 72, 64, False),
                               (384, 40, 384, True), (2048, 520, 128, True), (11008, 136, 128, False)):
            g = -(-k // gs)
            q = torch.randint(0, 16, (k, n))
            scales = torch.rand(g, n) * 0.02 + 0.001
            zeros = torch.randint(0, 17, (g, n)) if asym else torch.full((g, n), 8)
            w = ops.make_packed_weight(q, scales, zeros, gs, None, dtype, "cuda")
            for m in (1, 3, 8, 9, 16):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = ops.gptq_matmul_reference(x, w).float()
                print(f"  {dtype} k={k} n={n} gs={gs} asym={asym} m={m}", flush=True)
                for split in (1, 2, 3, None):
                    out = ops._launch_cuda(x, w, None, kernel="mma", split=split).float()
                    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                    worst = max(worst, err)
                    if err > 2e-2:
                        print(f"BAD {dtype} k={k} n={n} gs={gs} asym={asym} m={m} split={split}: {err}")
    print(f"correctness: worst rel err {worst:.2e}", flush=True)
    return worst


def sweep() -> None:
    weights = pagedq_weights()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    xs = {m: {k: torch.randn(m, k, device="cuda", dtype=torch.float16) for k in (4096, 11008)}
          for m in (1, 16)}
    for si, (name, k, n) in enumerate(SHAPES):
        ws = weights[si :: len(SHAPES)]
        nbytes = sum(w.qweight.numel() * 4 + w.scales.numel() * 2 for w in ws)
        for m in (1, 16):
            auto = gptq_configs.mma_split_k(n, -(-k // 128), sms, 1 if m == 1 else 16)
            row = []
            for split in (1, 2, 3, 4, 6, 8):
                def run(split: int = split) -> None:
                    for w in ws:
                        ops._launch_cuda(xs[m][k], w, None, kernel="mma", split=split)
                try:
                    ms = time_ms(graphed(run), 20)
                except RuntimeError:
                    continue
                row.append(f"s{split} {ms * 1000 / len(ws):.1f}us {nbytes / ms / 1e9:.2f}TB/s")
            def old() -> None:
                for w in ws:
                    ops._launch_cuda(xs[m][k], w, None, kernel="gemv")
            ms = time_ms(graphed(old), 20)
            print(f"{name} {k}x{n} M={m} auto=s{auto}: " + ", ".join(row)
                  + f" | gemv {ms * 1000 / len(ws):.1f}us", flush=True)
    for m in (1, 16):
        def stack(m: int = m) -> None:
            for w in weights:
                ops._launch_cuda(xs[m][w.in_features], w, None, kernel="mma")
        ms = time_ms(graphed(stack), 20)
        print(f"STACK M={m}: mma auto {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    from cuda_ext.build import gptq_ext_available

    assert gptq_ext_available(torch.device("cuda"))
    bad = check()
    if "--check-only" not in sys.argv:
        sweep()
    if "--probe" in sys.argv:
        import os

        os.environ["PAGEDQ_MMA_PROBE"] = "1"
        print("PROBE: tile-major addressing")
        sweep()
