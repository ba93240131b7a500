"""Sweep the GPTQ Triton launch configs per layer shape and fill `gptq_configs.TUNED` (GPU only).

Used by `bench/bench_gptq.py --sweep`: for each Llama-2-7B layer shape (N, K) and each swept M,
every candidate config is installed as that shape's `TUNED` entry and the real dispatch
(`pagedq.ops.gptq._launch_triton`) is timed over the shape's 32 copies (one CUDA graph, so
nothing stays in L2). The best config per (shape, M) is then installed in `TUNED` for this
process and returned, with `format_table` giving the Python text to paste into gptq_configs.py.
Configs that fail to compile (shared memory, registers) are recorded as failures and skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from triton_kernels import gptq_configs as cfgs
from triton_kernels.gptq_configs import KernelConfig

# (swept M, bucket bound) per kind: the best config at M serves every M up to the bound
SMALL_BUCKETS = ((1, 1), (16, 16))
LARGE_BUCKETS = ((64, 64), (256, 1 << 30))
Timer = Callable[[list[Any], int, Callable[..., Any]], float]  # (weights, m, call) -> ms


def small_candidates() -> list[KernelConfig]:
    """Split-K GEMV configs: BLOCK_N x SPLIT_K x warps (24), 4 stages, and the swapped-operand
    form (weights as tl.dot's first operand) of the narrower ones with 3 or 4 stages (12)."""
    grid = itertools.product((64, 128, 256), (2, 4, 8, 16), (4, 8))
    found = [KernelConfig(16, bn, warps, 4, split_k=split) for bn, split, warps in grid]
    swapped = itertools.product((64, 128), (2, 4, 8), (3, 4))
    found += [
        KernelConfig(16, bn, 4, stages, split_k=split, swap_ab=1) for bn, split, stages in swapped
    ]
    return found


def large_candidates(m: int) -> list[KernelConfig]:
    """GEMM configs: BLOCK_M x BLOCK_N x warps x stages x operand order, split-K auto, plus the
    untuned default as the baseline; the swapped 64-column tiles of one warpgroup (the
    2026-11-30 winners) with 2-4 stages and split-K auto, 2 or 4. From 256 rows also 256-row
    swapped tiles, which dequantize each weight tile once for all 256 rows."""
    grid = itertools.product((64, 128), (128, 256), (4, 8), (3, 4), (0, 1))
    found = [
        KernelConfig(bm, bn, warps, stages, swap_ab=swap)
        for bm, bn, warps, stages, swap in grid
        if bm <= max(64, m)
    ]
    narrow = itertools.product((64, 128), (2, 3, 4), (0, 2, 4))
    found += [
        KernelConfig(bm, 64, 4, stages, split_k=split, swap_ab=1)
        for bm, stages, split in narrow
        if bm <= max(64, m)
    ]
    if m >= 256:
        found += [
            KernelConfig(256, bn, 8, stages, swap_ab=1)
            for bn, stages in itertools.product((64, 128), (2, 3))
        ]
    return [cfgs.large_m_config(m), *found]


def _time_config(
    timer: Timer, weights: list[Any], kind: str, m: int, cfg: KernelConfig
) -> float | None:
    from pagedq.ops import gptq as ops

    n, k = weights[0].out_features, weights[0].in_features
    key = (kind, n, k)
    saved = cfgs.TUNED.get(key)
    cfgs.TUNED[key] = ((1 << 30, cfg),)
    try:
        return timer(weights, m, lambda x, w: ops._launch_triton(x, w, None, kind == "small"))
    except Exception as exc:  # a config past the SM's resources: skip it
        print(f"    {kind} {n}x{k} M={m} {cfg}: failed ({type(exc).__name__})", flush=True)
        return None
    finally:
        if saved is None:
            cfgs.TUNED.pop(key, None)
        else:
            cfgs.TUNED[key] = saved


def sweep_shape(timer: Timer, weights: list[Any]) -> dict[str, Any]:
    """Best config per swept M for the weights of one shape; rows of every timing."""
    n, k = weights[0].out_features, weights[0].in_features
    rows: list[dict[str, Any]] = []
    best: dict[str, list[tuple[int, KernelConfig]]] = {"small": [], "large": []}
    plans = [("small", m, bound, small_candidates()) for m, bound in SMALL_BUCKETS]
    plans += [("large", m, bound, large_candidates(m)) for m, bound in LARGE_BUCKETS]
    for kind, m, bound, candidates in plans:
        default = cfgs.pick_config(kind == "small", m, n, k)
        timed = [(_time_config(timer, weights, kind, m, c), c) for c in candidates]
        rows += [{"kind": kind, "m": m, "config": repr(c), "ms": t} for t, c in timed]
        ok = [(t, c) for t, c in timed if t is not None]
        if not ok:
            continue
        ms, cfg = min(ok, key=lambda tc: tc[0])
        base = next((t for t, c in ok if c == default), None)
        base_txt = f"{base:.4f}" if base is not None else "n/a"
        print(
            f"  sweep {n}x{k} {kind} M={m}: best {ms:.4f} ms for 32 copies "
            f"(default {base_txt}): {cfg}",
            flush=True,
        )
        best[kind].append((bound, cfg))
    return {"n": n, "k": k, "rows": rows, "best": best}


def sweep_and_apply(timer: Timer, weights: list[Any]) -> dict[str, Any]:
    """Sweep every distinct shape in `weights`, install the winners in TUNED, print the table."""
    shapes: dict[tuple[int, int], list[Any]] = {}
    for w in weights:
        shapes.setdefault((w.out_features, w.in_features), []).append(w)
    results = [sweep_shape(timer, group) for group in shapes.values()]
    for r in results:
        for kind, entries in r["best"].items():
            if entries:
                cfgs.TUNED[(kind, r["n"], r["k"])] = tuple(entries)
    table = format_table(results)
    print(table, flush=True)
    for r in results:  # JSON-ready: the winners as their config text
        r["best"] = {kind: [[b, repr(c)] for b, c in e] for kind, e in r["best"].items()}
    return {"shapes": results, "table": table}


def format_table(results: list[dict[str, Any]]) -> str:
    """The swept winners as the text of `gptq_configs.TUNED` (positional KernelConfig fields)."""
    lines = ["TUNED: dict[tuple[str, int, int], ConfigTable] = {"]
    for r in results:
        for kind, entries in r["best"].items():
            if entries:
                lines.append(f'    ("{kind}", {r["n"]}, {r["k"]}): (')
                lines += [f"        ({_bound(bound)}, {_config(cfg)})," for bound, cfg in entries]
                lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def _bound(bound: int) -> str:
    return "1 << 30" if bound == 1 << 30 else str(bound)


def _config(cfg: KernelConfig) -> str:
    fields = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.group_m, cfg.split_k)
    swap = f", swap_ab={cfg.swap_ab}" if cfg.swap_ab else ""
    return f"KernelConfig({', '.join(map(str, fields))}{swap})"


__all__ = ["format_table", "sweep_and_apply", "sweep_shape"]
