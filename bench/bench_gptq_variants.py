"""W4a stacks for the checkpoint variants beside the bench's symmetric g128: asymmetric g128 and
symmetric g64 (pagedq only).

Conditions: the bench_gptq.py stack (32 Llama-2-7B layers, fused projections, 128 launches, fp16
activations, one CUDA graph per stack, medians of CUDA-event-timed replays) with the same packed
weights; the asymmetric set adds random zero points z' in 0..15 per group, the g64 set has 64-row
groups (its own random scales). Each row also gives the max error of one layer against the
dequantize-then-matmul reference, relative to the reference's largest value.

Run (about a minute on an H200):
    PYTHONPATH=. python3 bench/bench_gptq_variants.py --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import torch
import triton

from bench.gptq_stacks import graphed, pagedq_stack, pagedq_weights, time_ms
from pagedq.ops import gptq as ops
from pagedq.ops.gptq import PackedGPTQWeight


def variant(weights: list[PackedGPTQWeight], zeros: bool, group: int) -> list[PackedGPTQWeight]:
    """The same packed words with zero points and/or another group size."""
    out = []
    for w in weights:
        groups, n = w.in_features // group, w.out_features
        z = torch.randint(0, 16, (groups, n), device="cuda").half() if zeros else None
        s = w.scales
        if group != w.group_size:
            s = (torch.rand(groups, n, device="cuda") * 0.01 + 0.001).half()
        out.append(dataclasses.replace(w, scales=s, zeros=z, group_size=group))
    return out


def rel_error(weight: PackedGPTQWeight, m: int) -> float:
    x = torch.randn(m, weight.in_features, device="cuda", dtype=torch.float16)
    ref = ops.gptq_matmul_reference(x, weight).float()
    got = ops.gptq_matmul(x, weight).float()
    return float(((got - ref).abs().max() / ref.abs().max()).item())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    base = pagedq_weights()
    sets = {
        "sym g128": (base, (16, 64, 256)),
        "asym g128": (variant(base, True, 128), (16, 64)),
        "sym g64": (variant(base, False, 64), (16, 64)),
    }
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = " ".join([sys.executable, *sys.argv])
    lines = [
        f"# W4a checkpoint variants, {torch.cuda.get_device_name(0)}, {date}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}; "
        f"`{command}`",
        "",
        "| weights | M | graph ms | max rel err (one layer) |",
        "| --- | --- | --- | --- |",
    ]
    for name, (weights, ms) in sets.items():
        for m in ms:
            ms_graph = time_ms(graphed(pagedq_stack(weights, m)), args.repeats)
            lines.append(f"| {name} | {m} | {ms_graph:.3f} | {rel_error(weights[0], m):.1e} |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gptq_w4a_variants_{date[:10]}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
