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
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from pagedq.ops import attention as attn
from triton_kernels import paged_cascade, paged_decode, paged_prefill
from triton_kernels.paged_cascade import CascadeConfig
from triton_kernels.paged_decode import DecodeConfig
from triton_kernels.paged_prefill import PrefillConfig

COPY_CEILING_TBS = 4.28
PAGE, HEAD_DIM, DTYPE, DEVICE = 16, 128, torch.bfloat16, "cuda"


@dataclass(frozen=True)
class DecodeCase:
    name: str
    batch: int
    mean_own: int  # mean of each sequence's own tokens
    kv_heads: int = 8
    heads: int = 32
    shared: int = 0  # shared prefix tokens (a multiple of PAGE)
    flashinfer_ref_us: float | None = None  # targets.md, measured 2026-11-29
    target_us: float | None = None


DECODE_CASES = [
    DecodeCase("B=64 mean 2191", 64, 2191, flashinfer_ref_us=168.7, target_us=160),
    DecodeCase("B=64 mean 559", 64, 559, flashinfer_ref_us=58.9, target_us=55),
    DecodeCase("B=256 mean 1001", 256, 1001, flashinfer_ref_us=273.1, target_us=270),
    DecodeCase("B=64 shared 2048+135", 64, 135, shared=2048, flashinfer_ref_us=84.8, target_us=80),
    DecodeCase("MHA 32/32 B=64 mean 1001", 64, 1001, kv_heads=32),
    DecodeCase("B=8 mean 2048", 8, 2048),  # small batch: many splits
]
DECODE_CONFIGS = [  # (block_n, num_warps, num_stages); the first is the default
    (128, 4, 3), (128, 4, 2), (64, 2, 3), (64, 4, 3), (128, 8, 3), (64, 2, 2),
]  # fmt: skip
DECODE_SPLITS = [1, 2, 3, 4, 6, 8, 16]
CASCADE_CONFIGS = [  # prefix kernel (block_m, block_n, num_warps, num_stages); first: default
    (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 32, 4, 3),
]  # fmt: skip
CASCADE_PREFIX_SPLITS = [None, 2, 4, 8, 16]  # None: about one wave of prefix programs
CASCADE_OWN = [  # own-part decode (tiles, split count) with the default prefix config
    (None, 1), (None, 2), ((64, 2, 3), None), ((64, 2, 3), 1), ((64, 4, 3), 1),
]  # fmt: skip


@dataclass(frozen=True)
class PrefillCase:
    name: str
    seqs: int
    new: int  # new tokens per sequence
    cached: int = 0  # cached prefix tokens per sequence
    kv_heads: int = 8
    heads: int = 32


PREFILL_CASES = [
    PrefillCase("4 x 2048 new", 4, 2048),
    PrefillCase("16 x 512 new", 16, 512),
    PrefillCase("8 x 1024 new", 8, 1024),  # where m64/n32 hands over to m128/n64
    PrefillCase("8 x (1536 cached + 512 new)", 8, 512, cached=1536),
]
PREFILL_CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3),
    (128, 64, 4, 4), (64, 32, 4, 4), (64, 32, 2, 3),
]  # fmt: skip

Timing = float | str  # microseconds, or why it could not be measured


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


def sample_lengths(n: int, mean: int, gen: torch.Generator) -> list[int]:
    lo, hi = max(mean // 2, 1), max(3 * mean // 2, 1)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen)
    diff = mean * n - int(lens.sum())
    for i in torch.randperm(n, generator=gen).tolist():  # nudge to the exact mean
        step = max(min(diff, hi - int(lens[i])), lo - int(lens[i]))
        lens[i] += step
        diff -= step
    return lens.tolist()


@dataclass
class PagedPool:
    k_cache: torch.Tensor  # [num_blocks, PAGE, kv_heads, HEAD_DIM]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    lens: list[int]
    pages: list[list[int]]  # each sequence's page ids


def build_pool(lens_own: list[int], shared: int, kv_heads: int, gen: torch.Generator) -> PagedPool:
    own_pages = [math.ceil(n / PAGE) for n in lens_own]
    num_blocks = shared // PAGE + sum(own_pages) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    prefix, rest = perm[: shared // PAGE], perm[shared // PAGE :]
    starts = [sum(own_pages[:i]) for i in range(len(own_pages))]
    pages = [prefix + rest[a : a + n] for a, n in zip(starts, own_pages, strict=True)]
    tables = torch.zeros(len(lens_own), max(len(p) for p in pages), dtype=torch.int32)
    for i, p in enumerate(pages):
        tables[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    shape = (num_blocks, PAGE, kv_heads, HEAD_DIM)
    lens = [shared + n for n in lens_own]
    k, v = (torch.randn(shape, dtype=DTYPE, device=DEVICE) for _ in range(2))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return PagedPool(k, v, tables.to(DEVICE), seq_lens, lens, pages)


def contiguous_kv(pool: PagedPool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, kv_heads, Lmax, D] copies of the paged K/V and a [B, 1, 1, Lmax] key mask."""
    max_len = max(pool.lens)
    pages = pool.block_tables[:, : math.ceil(max_len / PAGE)].long()
    k = pool.k_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    v = pool.v_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    mask = torch.arange(max_len, device=DEVICE)[None, :] < pool.seq_lens[:, None]
    return k, v, mask[:, None, None, :]


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
    args = (q, pool.k_cache, pool.v_cache, pool.block_tables, pool.seq_lens)
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


def bench_cascade(row: dict, case: DecodeCase, args: tuple, scale: float, max_len: int) -> None:
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
            lambda c=c: paged_prefill.launch(*args, scratch, scale, c)
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


def environment() -> dict:
    try:
        import flashinfer  # type: ignore[import-not-found]

        fi_version = getattr(flashinfer, "__version__", "unknown")
    except Exception:
        fi_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "flashinfer": fi_version, "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "dtype": str(DTYPE), "page_size": PAGE, "head_dim": HEAD_DIM,
    }  # fmt: skip


def _fmt(x: object, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("-" if x is None else str(x)[:32])


DECODE_COLUMNS = [  # (header, row key, digits)
    ("case", "name", 0), ("pagedq eager", "pagedq_us", 1),
    ("pagedq device", "pagedq_device_us", 1), ("TB/s", "pagedq_device_tbs", 2),
    ("pagedq host", "pagedq_host_us", 1),
    ("plan", "auto", 0), ("best swept device", "best_device_us", 1), ("config", "best", 0),
    ("flashinfer eager", "flashinfer_us", 1), ("flashinfer device", "flashinfer_device_us", 1),
    ("TB/s", "flashinfer_device_tbs", 2), ("target", "target_us", 1),
    ("flashinfer (targets.md)", "flashinfer_ref_us", 1),
]  # fmt: skip
CASCADE_COLUMNS = [
    ("case", "name", 0), ("pagedq cascade eager", "cascade_us", 1),
    ("cascade device", "cascade_device_us", 1), ("cascade host", "cascade_host_us", 1),
    ("plan", "cascade_plan", 0), ("best swept device", "cascade_best_device_us", 1),
    ("config", "cascade_best", 0), ("plain pagedq device", "pagedq_device_us", 1),
    ("flashinfer device", "flashinfer_device_us", 1), ("target", "target_us", 1),
    ("max diff vs plain", "cascade_max_abs_diff_vs_plain", 4),
]  # fmt: skip
PREFILL_COLUMNS = [
    ("case", "name", 0), ("pagedq", "pagedq_us", 1), ("TFLOP/s", "pagedq_tflops", 1),
    ("config", "auto", 0), ("best swept", "best_us", 1), ("TFLOP/s", "best_tflops", 1),
    ("config", "best", 0), ("SDPA", "sdpa_us", 1), ("TFLOP/s", "sdpa_tflops", 1),
    ("SDPA backend", "sdpa_backend", 0), ("pagedq / SDPA", "pagedq_vs_sdpa", 2),
    ("best / SDPA", "best_vs_sdpa", 2),
]  # fmt: skip


def _table(columns: list[tuple[str, str, int]], rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(key), d) for _, key, d in columns) + " |")
    return lines


def markdown(env: dict, decode: list[dict], prefill: list[dict]) -> str:
    lines = [
        f"# Paged attention, {env['gpu']}, {env['date']}", "",
        f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
        f"flashinfer {env['flashinfer']}, Python {env['python']}; `{env['command']}`", "",
        "## Decode (bf16, page 16, head_dim 128); µs (eager: host included; device: CUDA "
        "graph), TB/s of device time vs the 4.28 TB/s copy ceiling", "",
        *_table(DECODE_COLUMNS, decode), "",
        "## Decode over a shared prefix: pagedq cascade (shared_prefix_len = the prefix)", "",
        *_table(CASCADE_COLUMNS, [r for r in decode if "cascade_us" in r]), "",
        "## Prefill (bf16, 32/8 heads, head_dim 128); eager µs and TFLOP/s", "",
        *_table(PREFILL_COLUMNS, prefill),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def summary(decode: list[dict], prefill: list[dict]) -> str:
    def count(pairs: list[tuple[object, object]]) -> str:
        wins = sum(isinstance(a, float) and isinstance(b, int | float) and a <= b for a, b in pairs)
        return f"{wins}/{len(pairs)}"

    eager = count([(r["pagedq_us"], r["flashinfer_us"]) for r in decode])
    device = count([(r["pagedq_device_us"], r["flashinfer_device_us"]) for r in decode])
    met = count([(_fastest(r), r["target_us"]) for r in decode if r["target_us"]])
    close = count([(r.get("pagedq_vs_sdpa"), 1.3) for r in prefill])
    shared = [r for r in decode if "cascade_us" in r]
    cascade = count([(r["cascade_device_us"], r["flashinfer_device_us"]) for r in shared])
    return (
        f"decode at or under flashinfer on {eager} cases eager, {device} device; eager targets "
        f"met on {met} (cascade where shared); cascade device at or under flashinfer on "
        f"{cascade}; prefill within 1.3x of SDPA on {close}"
    )


def _fastest(row: dict) -> Timing:
    """pagedq's eager time, the cascade's where the case has one and it is faster."""
    times = [t for t in (row["pagedq_us"], row.get("cascade_us")) if isinstance(t, float)]
    return min(times) if times else row["pagedq_us"]


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
