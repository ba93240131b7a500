"""W4a: the 224 GPTQ linears of a Llama-2-7B decode step: pagedq vs cuBLAS fp16, aten int4, Marlin.

Conditions: one GPU, the 32 layers of Llama-2-7B with fused projections, as the model runs
them: per layer qkv 4096->12288, o 4096->4096, gate_up 4096->22016, down 11008->4096 (224
checkpoint linears in 128 launches), random 4-bit weights, group size 128, symmetric (3.34 GB:
nothing stays in L2), fp16 activations (bf16 for aten's tinygemm; `pagedq_bf16` rows run the same
weights with bf16 scales and activations). For each batch M the whole stack is captured in one
CUDA graph and replayed (eager time in brackets); medians of CUDA-event-timed repeats. TB/s =
weight bytes read / time, against the 4.28 TB/s copy ceiling.

Peers, same graph method: dense fp16 cuBLAS (12.95 GB of weights), aten
`torch._weight_int4pack_mm` (tinygemm, bf16), and Marlin through GPTQModel when importable.
Then the small-M paths alone (CUDA extension vs Triton GEMV, Triton GEMV vs GEMM) at
M = 1..32, to set the dispatch thresholds in pagedq/ops/gptq.py.

Run (about 3-4 minutes on an H200, including the CUDA extension build; --sweep adds about 2-3
minutes: it times the Triton configs per layer shape at M = 1, 16, 64, 256, prints the
`gptq_configs.TUNED` table and re-times the stack with it as `pagedq_tuned`):
    PYTHONPATH=. python3 bench/bench_gptq.py --out bench/results --sweep
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import triton

from bench.gptq_stacks import (
    SHAPES,
    Stack,
    dense_stack,
    dense_weights,
    graphed,
    marlin_layers,
    module_stack,
    pagedq_stack,
    pagedq_weights,
    smi_query,
    time_ms,
    tinygemm_layers,
    tinygemm_stack,
    weight_bytes,
)
from pagedq.ops import gptq as ops
from pagedq.ops.gptq import PackedGPTQWeight

COPY_CEILING_TBS = 4.28
MS = (1, 16, 64, 256)
PATH_MS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
TARGETS_MS = {1: 1.1, 16: 1.4, 64: 3.5}  # targets.md W4a (M=256: within 1.2x of dense fp16)


# --- measurement --------------------------------------------------------------------------


def measure(fn: Stack, nbytes: int, repeats: int) -> dict[str, float]:
    eager = time_ms(fn, max(3, repeats // 4))
    graph = time_ms(graphed(fn), repeats)
    return {"graph_ms": graph, "eager_ms": eager, "tbs": nbytes / graph / 1e9}


def sample_clocks(fn: Stack, seconds: float) -> list[float] | None:
    """[SM MHz, board W] while `fn`'s graph replays for `seconds` (None: off or no nvidia-smi)."""
    return smi_query("clocks.sm,power.draw", seconds, graphed(fn)) if seconds > 0 else None


def accuracy(weights: list[PackedGPTQWeight], ms: list[int]) -> dict[str, float]:
    """Worst max|error| / max|reference| of each path over the first layer's four linears."""
    worst: dict[str, float] = {}
    for m in ms:
        paths = ["cuda", "triton"] if m <= ops.SMALL_M_MAX_M else ["triton"]
        for backend in paths:
            for w in weights[: len(SHAPES)]:
                x = torch.randn(m, w.in_features, device="cuda", dtype=torch.float16)
                out = with_backend(backend, functools.partial(ops.gptq_matmul, x, w)).float()
                ref = ops.gptq_matmul_reference(x.float(), replace(w, scales=w.scales.float()))
                key = f"M={m} {backend}"
                worst[key] = max(
                    worst.get(key, 0.0), ((out - ref).abs().max() / ref.abs().max()).item()
                )
    return worst


def with_backend(name: str, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(ops.BACKEND_ENV)
    os.environ[ops.BACKEND_ENV] = name
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(ops.BACKEND_ENV, None)
        else:
            os.environ[ops.BACKEND_ENV] = old


def path_sweep(weights: list[PackedGPTQWeight], nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Graph and eager time of the stack per path and M, to set the dispatch thresholds:
    SMALL_M_MAX_M (the CUDA GEMV against Triton) and the wgmma GEMM against the Triton GEMM
    above it (`cuda_gemm_tile` picks each layer's tile)."""
    paths: dict[str, Callable[..., torch.Tensor]] = {
        "cuda": lambda x, w: ops._launch_cuda(x, w, None, gemm=False),
        "cuda_gemm": lambda x, w: ops._launch_cuda(x, w, None, gemm=True),
        "triton_gemv": lambda x, w: ops._launch_triton(x, w, None, small=True),
        "triton_gemm": lambda x, w: ops._launch_triton(x, w, None, small=False),
    }
    x0 = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    if not ops._cuda_ext_applies(x0, weights[0]):
        del paths["cuda"], paths["cuda_gemm"]
    elif not ops._is_sm90(x0.device):
        del paths["cuda_gemm"]
    rows = []
    for m in PATH_MS:
        row: dict[str, Any] = {"m": m}
        for name, call in paths.items():
            small_only = name in ("cuda", "triton_gemv")
            if (m > ops.SMALL_M_MAX_M and small_only) or (m <= 16 and name == "cuda_gemm"):
                continue
            row[name] = measure(pagedq_stack(weights, m, call), nbytes, repeats)
        rows.append(row)
        print(
            f"  path sweep M={m}: "
            + ", ".join(
                f"{k} {v['graph_ms']:.3f} ms ({v['eager_ms']:.3f})"
                for k, v in row.items()
                if k != "m"
            ),
            flush=True,
        )
    return rows


def run_peer(
    name: str, build: Callable[[], Any], results: dict[str, Any], fn: Callable[[Any], None]
) -> None:
    state = None
    try:
        state = build()
        fn(state)
    except Exception as exc:  # peers are optional: record why and go on
        results["skipped"][name] = " ".join(str(exc).split())[:300] or type(exc).__name__
        print(f"  {name}: skipped ({results['skipped'][name]})", flush=True)
    del state
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ms", type=str, default=",".join(map(str, MS)))
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--clocks", type=float, default=2.0,
        help="seconds of replays per pagedq row and M while nvidia-smi samples the SM clock and "
        "board power (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep the Triton configs per layer shape (M=1, 16, 64, 256), print the TUNED "
        "table and re-time the stack with it",
    )
    parser.add_argument("--sweep-repeats", type=int, default=10)
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {
        "workload": "W4a: 224 GPTQ linears of a Llama-2-7B decode step (128 launches), g128 sym",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": props.name, "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "command": " ".join([sys.executable, *sys.argv]),
        "thresholds": {"SMALL_M_MAX_M": ops.SMALL_M_MAX_M},
        "rows": {}, "skipped": {}, "peers": "off" if args.no_peers else "pending",
    }  # fmt: skip
    limits = smi_query("power.limit,clocks.max.sm")
    if limits is not None:
        results["power_limit_w"], results["max_sm_mhz"] = limits
    weights = pagedq_weights()
    nbytes = weight_bytes(weights)
    results["weight_gb"] = nbytes / 1e9
    print(
        f"{props.name}: pagedq weights {nbytes / 1e9:.2f} GB; building the CUDA extension ...",
        flush=True,
    )

    def pagedq_rows(name: str, ws: list[PackedGPTQWeight]) -> None:
        """Row `name` at every M: the stack of `ws` on the `auto` dispatch."""
        for m in ms:
            stack = pagedq_stack(ws, m)
            r = results["rows"].setdefault(str(m), {})[name] = with_backend(
                "auto", functools.partial(measure, stack, nbytes, args.repeats)
            )
            sampled = with_backend("auto", functools.partial(sample_clocks, stack, args.clocks))
            clock = ""
            if sampled is not None:
                r["sm_mhz"], r["board_w"] = sampled
                clock = f", {sampled[0]:.0f} MHz, {sampled[1]:.0f} W"
            times = f"{r['graph_ms']:.3f} ms ({r['eager_ms']:.3f})"
            print(f"  M={m}: {name} {times}{clock}", flush=True)

    pagedq_rows("pagedq", weights)
    pagedq_rows("pagedq_bf16", [replace(w, scales=w.scales.bfloat16()) for w in weights])
    results["paths"] = path_sweep(weights, nbytes, args.repeats)
    if args.sweep:
        from triton_kernels.gptq_tuning import sweep_and_apply

        def timer(ws: list[PackedGPTQWeight], m: int, call: Callable[..., Any]) -> float:
            return time_ms(graphed(pagedq_stack(ws, m, call)), args.sweep_repeats)

        results["config_sweep"] = sweep_and_apply(timer, weights)
        pagedq_rows("pagedq_tuned", weights)  # with the swept table
    results["max_rel_error"] = accuracy(weights, ms)
    print(
        "  accuracy vs reference: "
        + ", ".join(f"{k} {v:.1e}" for k, v in results["max_rel_error"].items()),
        flush=True,
    )
    if not args.no_peers:
        # pagedq's figures survive a run stopped among the peers (printed once, at the end)
        write(results, args.out, echo=False)
        peers(results, ms, args.repeats)
        results["peers"] = "done"
    write(results, args.out)


def peers(results: dict[str, Any], ms: list[int], repeats: int) -> None:
    def dense(weights: list[torch.Tensor]) -> None:
        nbytes = sum(w.numel() * 2 for w in weights)
        for m in ms:
            results["rows"][str(m)]["dense_fp16"] = measure(
                dense_stack(weights, m), nbytes, repeats
            )

    def tinygemm(layers: Any) -> None:
        nbytes = sum(w.numel() * w.element_size() + sz.numel() * 2 for w, sz, _ in layers)
        for m in ms:
            results["rows"][str(m)]["aten_int4"] = measure(
                tinygemm_stack(layers, m), nbytes, repeats
            )

    def marlin(layers: Any) -> None:
        nbytes = sum(lin.qweight.numel() * 4 + lin.scales.numel() * 2 for lin in layers)
        for m in ms:
            results["rows"][str(m)]["marlin"] = measure(module_stack(layers, m), nbytes, repeats)

    run_peer("dense_fp16", dense_weights, results, dense)
    run_peer("aten_int4", tinygemm_layers, results, tinygemm)
    run_peer("marlin", marlin_layers, results, marlin)


def write(results: dict[str, Any], out: Path, echo: bool = True) -> None:
    """The results files (`gptq_w4a_DATE.md` / `.json`) under `out`; with `echo`, the table and
    the verdict per target on stdout too."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = results["date"][:10]
    lines = [
        f"# W4a GPTQ linears, {results['gpu']}, {results['date']}",
        "",
        f"torch {results['torch']}, triton {results['triton']}, CUDA {results['cuda']}; "
        f"weights {results['weight_gb']:.2f} GB; `{results['command']}`",
    ]
    if "power_limit_w" in results:
        lines.append(
            f"Board power limit {results['power_limit_w']:.0f} W, SM clock at most "
            f"{results['max_sm_mhz']:.0f} MHz; SM MHz / board W: medians of nvidia-smi's samples "
            "while the stack replays."
        )
    lines += [
        "",
        "| M | kernel | graph ms | eager ms | TB/s | % of 4.28 | SM MHz | board W |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m, row in results["rows"].items():
        for name, r in row.items():
            pct = 100 * r["tbs"] / COPY_CEILING_TBS
            mhz = f"{r['sm_mhz']:.0f} | {r['board_w']:.0f}" if "sm_mhz" in r else "– | –"
            lines.append(
                f"| {m} | {name} | {r['graph_ms']:.3f} | {r['eager_ms']:.3f} | "
                f"{r['tbs']:.2f} | {pct:.0f}% | {mhz} |"
            )
    lines += ["", "Paths by M (graph ms, eager in brackets): " + "; ".join(
        f"M={r['m']}: " + ", ".join(
            f"{k} {v['graph_ms']:.3f} ({v['eager_ms']:.3f})" for k, v in r.items() if k != "m"
        )
        for r in results["paths"]
    )]  # fmt: skip
    if results["peers"] == "pending":
        lines += ["", "Peers: not measured (the run stopped before they were done)."]
    if results["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in results["skipped"].items())]
    (out / f"gptq_w4a_{stamp}.json").write_text(json.dumps(results, indent=2))
    (out / f"gptq_w4a_{stamp}.md").write_text("\n".join(lines) + "\n")
    if not echo:
        return
    print("\n".join(lines[4:]))
    summary = []
    for m, row in results["rows"].items():
        target = TARGETS_MS.get(int(m))
        ours = row["pagedq"]["graph_ms"]
        verdict = f" target {target} ms: {'met' if ours <= target else 'MISSED'}" if target else ""
        if "dense_fp16" in row:
            verdict += f" ({ours / row['dense_fp16']['graph_ms']:.2f}x dense fp16)"
        summary.append(f"M={m} {ours:.3f} ms{verdict}")
    print(f"W4a {results['gpu']}: " + "; ".join(summary))


if __name__ == "__main__":
    main()
