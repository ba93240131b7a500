"""W4b: paged decode attention (and prefill attention) of pagedq vs torch SDPA and flashinfer.

Conditions: one H200-class GPU, bf16, one layer, 32 query / 8 KV heads (Llama-3-8B) and 32/32
(Llama-2-7B), head_dim 128, page 16, every sequence's pages scattered over the pool. Lengths
are uniform in [mean/2, 3*mean/2] (seeded), nudged to the exact mean; the shared case gives
every sequence the same 2,048-token prefix pages plus its own tokens.

Timing, L2 flushed before every repeat: "eager" is do_bench of the Python call (host overhead
included wherever the host is slower than the GPU); "device" replays the call captured in a
CUDA graph (kernels alone); "host" is the CPU time of one call, GPU work aside. Decode TB/s =
(K/V bytes needed, a shared prefix once, + q + out) / device time; prefill TFLOP/s counts the
causal QK^T and PV FLOPs. Peers: SDPA on contiguous copies; flashinfer's
BatchDecodeWithPagedKVCacheWrapper (NHD, planned outside the timing, the faster of its
CUDA-core and tensor-core variants). pagedq runs through its public op (heuristic plan), then
its kernels are swept over tiles x split counts (device time, and each compiled variant's
shared memory and registers). On the shared case, "pagedq cascade" is the same op with
shared_prefix_len=2048 (the prefix read once per KV head), swept over prefix tiles x prefix
splits and own-part tiles x splits.

Run (1-3 minutes on an H200, flashinfer JIT aside):
    PYTHONPATH=. python3 bench/bench_attention.py --out bench/results
Only the shared case and its sweeps (under a minute):
    PYTHONPATH=. python3 bench/bench_attention.py --only shared --skip-prefill --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.attention_cases import (
    CASCADE_CONFIGS,
    CASCADE_OWN,
    CASCADE_PREFIX_SPLITS,
    DECODE_CASES,
    DECODE_CONFIGS,
    DECODE_SPLITS,
    DEVICE,
    DTYPE,
    HEAD_DIM,
    PAGE,
    PREFILL_CASES,
    PREFILL_CONFIGS,
    DecodeArgs,
    DecodeCase,
    PagedPool,
    PrefillCase,
    Timing,
    build_pool,
    contiguous_kv,
    sample_lengths,
)
from bench.attention_report import environment, markdown, summary
from pagedq.ops import attention as attn
from triton_kernels import paged_cascade, paged_decode, paged_prefill
from triton_kernels.paged_cascade import CascadeConfig
from triton_kernels.paged_decode import DecodeConfig
from triton_kernels.paged_prefill import PrefillConfig


def _failed(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def eager_us(fn: Callable[[], object]) -> Timing:
    try:
        fn()
        return float(do_bench(fn, warmup=10, rep=40, return_mode="median")) * 1e3
    except Exception as exc:  # a config that does not fit, a peer that cannot run
        return _failed(exc)


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Host time of one call: `calls` calls enqueued back to back (fewer launches than the
    GPU queue holds, so none waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


_FLUSH: list[torch.Tensor] = []


def device_us(fn: Callable[[], object], reps: int = 40) -> Timing:
    """Median time of one fn() replayed from a CUDA graph, L2 flushed before each replay."""
    try:
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        if not _FLUSH:
            _FLUSH.append(torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE))
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
        for start, end in events:
            _FLUSH[0].zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        return times[reps // 2] * 1e3
    except Exception as exc:
        return _failed(exc)


def compiled_info(jit_fn: object, seen: set[int]) -> list[dict]:
    """Shared memory, registers and spills of the variants of `jit_fn` compiled since `seen`."""
    info = []
    try:
        for cache in jit_fn.device_caches.values():  # type: ignore[attr-defined]
            for kernel in cache[0].values():
                if id(kernel) not in seen:
                    seen.add(id(kernel))
                    md = kernel.metadata
                    info.append({"shared": md.shared, "regs": kernel.n_regs,
                                 "spills": kernel.n_spills, "warps": md.num_warps})  # fmt: skip
    except Exception as exc:  # the compiled-kernel API differs between Triton versions
        info.append({"error": _failed(exc)})
    return info


def flashinfer_decode(pool: PagedPool, case: DecodeCase, q: torch.Tensor, tensor_cores: bool):
    """A run() closure of flashinfer's paged decode, planned here; a string if unavailable."""
    try:
        import flashinfer  # type: ignore[import-not-found]

        indptr = torch.tensor([0] + [len(p) for p in pool.pages]).cumsum(0).int()
        indices = torch.tensor([i for p in pool.pages for i in p], dtype=torch.int32)
        last = torch.tensor([(n - 1) % PAGE + 1 for n in pool.lens], dtype=torch.int32)
        workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEVICE)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores
        )
        wrapper.plan(
            indptr.to(DEVICE), indices.to(DEVICE), last.to(DEVICE),
            case.heads, case.kv_heads, HEAD_DIM, PAGE,
            q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5,
        )  # fmt: skip
    except Exception as exc:
        return f"unavailable: {_failed(exc)}"
    return lambda: wrapper.run(q, (pool.k_cache, pool.v_cache))


def sdpa_decode(pool: PagedPool, case: DecodeCase, q: torch.Tensor) -> tuple[Timing, torch.Tensor]:
    """SDPA over a contiguous padded cache: each KV head's GROUP queries as a short query."""
    k, v, mask = contiguous_kv(pool)
    q4 = q.view(case.batch, case.kv_heads, case.heads // case.kv_heads, HEAD_DIM)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=HEAD_DIM**-0.5)
    return eager_us(sdpa), sdpa().reshape(q.shape)


def decode_peers(row: dict, pool: PagedPool, case: DecodeCase, q: torch.Tensor) -> None:
    """SDPA on a contiguous copy and flashinfer's two paged decode variants, into `row`."""
    out = row.pop("_out")
    row["sdpa_us"], ref = sdpa_decode(pool, case, q)
    row["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
    for name, tensor_cores in (("cuda_cores", False), ("tc", True)):
        fi = flashinfer_decode(pool, case, q, tensor_cores)
        eager, device = (fi, fi) if isinstance(fi, str) else (eager_us(fi), device_us(fi))
        row[f"flashinfer_{name}_us"], row[f"flashinfer_{name}_device_us"] = eager, device
        if not isinstance(fi, str):
            row["max_abs_diff_vs_flashinfer"] = float((out.float() - fi().float()).abs().max())
    for kind in ("", "_device"):
        timed = [row[f"flashinfer_{n}{kind}_us"] for n in ("cuda_cores", "tc")]
        floats = [t for t in timed if isinstance(t, float)]
        row[f"flashinfer{kind}_us"] = min(floats) if floats else timed[0]  # the faster of two


def bench_decode_case(case: DecodeCase, gen: torch.Generator) -> dict:
    lens_own = sample_lengths(case.batch, case.mean_own, gen)
    pool = build_pool(lens_own, case.shared, case.kv_heads, gen)
    q = torch.randn(case.batch, case.heads, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    scale, max_len = HEAD_DIM**-0.5, max(pool.lens)
    kv_tokens = case.shared + sum(n - case.shared for n in pool.lens)
    nbytes = 2 * kv_tokens * case.kv_heads * HEAD_DIM * 2 + 2 * q.numel() * 2
    args: DecodeArgs = (q, pool.k_cache, pool.v_cache, pool.block_tables, pool.seq_lens)
    row: dict = {"case": asdict(case), "name": case.name, "target_us": case.target_us,
                 "flashinfer_ref_us": case.flashinfer_ref_us, "bytes": nbytes,
                 "mean_len": sum(pool.lens) / len(pool.lens), "max_len": max_len}  # fmt: skip

    # -- pagedq: the public op (heuristic splits and tiles), eager and device time -------
    public = lambda: attn.paged_decode_attention(*args, scale, max_seq_len=max_len)
    row["_out"] = public()
    scratch = torch.empty_like(q)
    plan = paged_decode.launch(*args, scratch, scale, max_seq_len=max_len)
    row["auto"] = f"split{plan.num_splits}/chunk{plan.chunk_len}"
    row["pagedq_us"], row["pagedq_device_us"] = eager_us(public), device_us(public)
    launch = lambda: paged_decode.launch(*args, scratch, scale, max_seq_len=max_len)
    row["pagedq_host_us"], row["launch_host_us"] = host_us(public), host_us(launch)

    # -- sweep: tile configs x split counts, device time --------------------------------
    sweep: dict[str, Timing] = {}
    kernels: dict[str, list[dict]] = {}
    seen: set[int] = set()
    for bn, warps, stages in DECODE_CONFIGS:
        cfg = DecodeConfig(bn, warps, stages)
        for splits in sorted({plan.num_splits, *DECODE_SPLITS}):
            run = lambda s=splits, c=cfg: paged_decode.launch(
                *args, scratch, scale, s, c, max_seq_len=max_len
            )
            used = run()
            label = f"n{bn}/w{warps}/s{stages}/split{used.num_splits}"
            if label not in sweep:
                sweep[label] = device_us(run)
                kernels[label] = compiled_info(paged_decode._paged_decode_kernel, seen)
    row["sweep_device_us"], row["sweep_kernels"] = sweep, kernels
    row["best"] = _best(sweep)
    row["best_device_us"] = sweep[row["best"]]

    if case.shared:
        bench_cascade(row, case, args, scale, max_len)
    decode_peers(row, pool, case, q)
    for key in ("pagedq_device_us", "best_device_us", "flashinfer_device_us",
                "cascade_device_us", "cascade_best_device_us"):  # fmt: skip
        t = row.get(key)
        row[key.replace("_us", "_tbs")] = nbytes / t / 1e6 if isinstance(t, float) else None
    return row


def bench_cascade(
    row: dict, case: DecodeCase, args: DecodeArgs, scale: float, max_len: int
) -> None:
    """The cascade path on the same inputs: public op, then prefix x own-part sweeps."""
    prefix = case.shared
    public = lambda: attn.paged_decode_attention(
        *args, scale, max_seq_len=max_len, shared_prefix_len=prefix
    )
    out = public()
    row["cascade_max_abs_diff_vs_plain"] = float((out.float() - row["_out"].float()).abs().max())
    scratch = torch.empty_like(args[0])
    plan = paged_cascade.launch(*args, scratch, scale, prefix, max_seq_len=max_len)
    row["cascade_plan"] = (
        f"m{plan.prefix_constants['BLOCK_M']}/p{plan.prefix_splits}/own{plan.own_splits}"
    )
    row["cascade_us"], row["cascade_device_us"] = eager_us(public), device_us(public)
    row["cascade_host_us"] = host_us(public)

    def run(cfg: CascadeConfig, own_splits: int | None, own_cfg: DecodeConfig | None):
        return lambda: paged_cascade.launch(
            *args, scratch, scale, prefix, own_splits, cfg, own_cfg, max_seq_len=max_len
        )

    sweep: dict[str, Timing] = {}
    for bm, bn, warps, stages in CASCADE_CONFIGS:
        for splits in CASCADE_PREFIX_SPLITS:
            cfg = CascadeConfig(bm, bn, warps, stages, splits)
            used = run(cfg, None, None)()
            label = f"m{bm}/n{bn}/w{warps}/s{stages}/p{used.prefix_splits}/own{used.own_splits}"
            if label not in sweep:
                sweep[label] = device_us(run(cfg, None, None))
    for tiles, own_splits in CASCADE_OWN:
        own_cfg = DecodeConfig(*tiles) if tiles else None
        used = run(CascadeConfig(), own_splits, own_cfg)()
        own_label = f"n{tiles[0]}/w{tiles[1]}/s{tiles[2]}" if tiles else "default"
        label = f"default/p{used.prefix_splits}/own{used.own_splits} {own_label}"
        sweep.setdefault(label, device_us(run(CascadeConfig(), own_splits, own_cfg)))
    row["cascade_sweep_device_us"] = sweep
    row["cascade_best"] = _best(sweep)
    row["cascade_best_device_us"] = sweep[row["cascade_best"]]


def _best(sweep: dict[str, Timing]) -> str:
    timed = {key: t for key, t in sweep.items() if isinstance(t, float)}
    return min(timed, key=lambda key: timed[key]) if timed else next(iter(sweep))


def prefill_flops(case: PrefillCase) -> float:
    visible = sum(case.cached + r + 1 for r in range(case.new))  # keys seen, summed over rows
    return 4.0 * HEAD_DIM * visible * case.heads * case.seqs


def sdpa_prefill(case: PrefillCase, q: torch.Tensor, pool: PagedPool) -> tuple[Timing, str]:
    """SDPA (flash where it applies) on the same tokens laid out contiguously."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    qc = q.view(case.seqs, case.new, case.heads, HEAD_DIM).transpose(1, 2).contiguous()
    k, v, _ = contiguous_kv(pool)
    if case.cached == 0:
        gqa = lambda: F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = eager_us(gqa)
        if isinstance(t, float):
            return t, "flash, enable_gqa"
    group = case.heads // case.kv_heads
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if case.cached == 0:
        call = lambda: F.scaled_dot_product_attention(qc, ke, ve, is_causal=True)
    else:
        bias = causal_lower_right(case.new, case.cached + case.new)
        call = lambda: F.scaled_dot_product_attention(qc, ke, ve, attn_mask=bias)
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for backends, label in (([SDPBackend.FLASH_ATTENTION], "flash"), (every, "any")):
        with sdpa_kernel(backends):
            t = eager_us(call)
        if isinstance(t, float):
            return t, f"{label}, K/V repeated per head"
    return t, "failed"


def bench_prefill_case(case: PrefillCase, gen: torch.Generator) -> dict:
    total = case.cached + case.new
    pool = build_pool([total] * case.seqs, 0, case.kv_heads, gen)
    q = torch.randn(case.seqs * case.new, case.heads, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    qsl = torch.arange(0, case.seqs + 1, dtype=torch.int32, device=DEVICE) * case.new
    scale = HEAD_DIM**-0.5
    args = (q, pool.k_cache, pool.v_cache, pool.block_tables, pool.seq_lens, qsl, case.new)
    flops = prefill_flops(case)
    row: dict = {"case": asdict(case), "name": case.name, "flops": flops}
    public = lambda: attn.paged_prefill_attention(*args, scale, max_seq_len=total)
    out = public()
    cfg = paged_prefill.default_config(HEAD_DIM, case.new, total, DTYPE)
    row["auto"] = f"m{cfg.block_m}/n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
    row["pagedq_us"] = eager_us(public)
    scratch = torch.empty_like(q)
    sweep: dict[str, Timing] = {}
    for bm, bn, warps, stages in PREFILL_CONFIGS:
        c = PrefillConfig(bm, bn, warps, stages)
        sweep[f"m{bm}/n{bn}/w{warps}/s{stages}"] = eager_us(
            functools.partial(paged_prefill.launch, *args, scratch, scale, c)
        )
    row["sweep_us"], row["best"] = sweep, _best(sweep)
    row["best_us"] = sweep[row["best"]]
    row["sdpa_us"], row["sdpa_backend"] = sdpa_prefill(case, q, pool)
    if case.seqs * total <= 8192:
        ref = attn.reference_prefill_attention(*args[:6], scale)
        row["max_abs_diff_vs_reference"] = float((out.float() - ref.float()).abs().max())
    for key in ("pagedq_us", "best_us", "sdpa_us"):
        t = row.get(key)
        row[key.replace("_us", "_tflops")] = flops / t / 1e6 if isinstance(t, float) else None
    if isinstance(row["sdpa_us"], float):
        row["pagedq_vs_sdpa"] = row["pagedq_us"] / row["sdpa_us"]
        row["best_vs_sdpa"] = row["best_us"] / row["sdpa_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--only", default="", help="decode cases whose name contains this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    env = environment()
    print(json.dumps(env))
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    decode, prefill = [], []
    for case in [c for c in DECODE_CASES if args.only in c.name]:
        decode.append(bench_decode_case(case, gen))
        print(f"[{time.time() - start:6.1f}s] decode {case.name}: {json.dumps(decode[-1])}")
        torch.cuda.empty_cache()
    for pcase in [] if args.skip_prefill else PREFILL_CASES:
        prefill.append(bench_prefill_case(pcase, gen))
        print(f"[{time.time() - start:6.1f}s] prefill {pcase.name}: {json.dumps(prefill[-1])}")
        torch.cuda.empty_cache()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"environment": env, "decode": decode, "prefill": prefill}
    (args.out / f"attention_{stamp}.json").write_text(json.dumps(result, indent=1))
    table = markdown(env, decode, prefill)
    (args.out / f"attention_{stamp}.md").write_text(table)
    print(table)
    print(
        f"summary: {summary(decode, prefill)}; {time.time() - start:.0f}s; "
        f"results in {args.out}/attention_{stamp}.*"
    )


if __name__ == "__main__":
    main()
