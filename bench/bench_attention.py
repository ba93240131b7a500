"""W4b: paged decode attention (and prefill attention) of pagedq vs torch SDPA and flashinfer.

Conditions: one H200-class GPU, bf16, one layer, Llama-3-8B attention shape (32 query / 8 KV
heads, head_dim 128) plus the Llama-2-7B MHA shape (32/32), page size 16, pages of every
sequence scattered over the pool by a random permutation. Context lengths are drawn
uniformly in [mean/2, 3*mean/2] (seeded) and nudged to the exact mean; the shared-prefix case
gives every sequence the same 2,048-token prefix pages plus its own tokens.

Timing: triton.testing.do_bench, median, L2 flushed before every repeat (so only what one
call reuses stays in L2). Decode TB/s = (K/V bytes needed, a shared prefix counted once,
+ q + out) / time, against the 4.28 TB/s copy ceiling. Prefill TFLOP/s counts the causal
QK^T and PV FLOPs. Peers: torch SDPA on a contiguous padded cache (decode) or the same
tokens laid out contiguously (prefill, flash backend); flashinfer's
BatchDecodeWithPagedKVCacheWrapper (NHD, plan outside the timed region, the faster of its
CUDA-core and tensor-core variants) when importable.
pagedq is timed through its public op (shape heuristics), then its kernels are swept over
tile configs and split counts; the best is reported beside it.

Run (about 1-3 minutes on an H200, flashinfer JIT aside):
    PYTHONPATH=. python3 bench/bench_attention.py --out bench/results
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
from triton_kernels import paged_decode, paged_prefill
from triton_kernels.paged_decode import DecodeConfig
from triton_kernels.paged_prefill import PrefillConfig

COPY_CEILING_TBS = 4.28
PAGE = 16
HEAD_DIM = 128
DTYPE = torch.bfloat16
DEVICE = "cuda"


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
]
DECODE_CONFIGS = [  # (block_n, num_warps, num_stages)
    (64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (32, 4, 4),
    (128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 8, 3), (64, 2, 3),
]  # fmt: skip
DECODE_SPLITS = [1, 2, 3, 4, 6, 8, 16]


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
    PrefillCase("8 x (1536 cached + 512 new)", 8, 512, cached=1536),
]
PREFILL_CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3), (128, 32, 4, 3),
    (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 128, 4, 2),
]  # fmt: skip


def time_us(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median")) * 1e3


def try_time_us(fn: Callable[[], object]) -> float | str:
    try:
        fn()
        return time_us(fn)
    except Exception as exc:  # a config that does not fit, a peer that cannot run
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


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
    pages = []
    for n in own_pages:
        pages.append(prefix + rest[:n])
        rest = rest[n:]
    tables = torch.zeros(len(lens_own), max(len(p) for p in pages), dtype=torch.int32)
    for i, p in enumerate(pages):
        tables[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    shape = (num_blocks, PAGE, kv_heads, HEAD_DIM)
    lens = [shared + n for n in lens_own]
    return PagedPool(
        torch.randn(shape, dtype=DTYPE, device=DEVICE),
        torch.randn(shape, dtype=DTYPE, device=DEVICE),
        tables.to(DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        lens,
        pages,
    )


def contiguous_kv(pool: PagedPool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, kv_heads, Lmax, D] copies of the paged K/V and a [B, 1, 1, Lmax] key mask."""
    max_len = max(pool.lens)
    pages = pool.block_tables[:, : math.ceil(max_len / PAGE)].long()
    k = pool.k_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    v = pool.v_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).contiguous()
    mask = torch.arange(max_len, device=DEVICE)[None, :] < pool.seq_lens[:, None]
    return k, v, mask[:, None, None, :]


def flashinfer_decode(
    pool: PagedPool, case: DecodeCase, q: torch.Tensor, scale: float, tensor_cores: bool
):
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
            q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=scale,
        )  # fmt: skip
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    return lambda: wrapper.run(q, (pool.k_cache, pool.v_cache))


def sdpa_decode(pool: PagedPool, case: DecodeCase, q: torch.Tensor, scale: float):
    """SDPA over a contiguous padded cache: each KV head's GROUP queries as a short query."""
    k, v, mask = contiguous_kv(pool)
    q4 = q.view(case.batch, case.kv_heads, case.heads // case.kv_heads, HEAD_DIM)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=scale)
    return try_time_us(sdpa), sdpa().reshape(q.shape)


def bench_decode_case(case: DecodeCase, gen: torch.Generator) -> dict:
    pool = build_pool(
        sample_lengths(case.batch, case.mean_own, gen), case.shared, case.kv_heads, gen
    )
    q = torch.randn(case.batch, case.heads, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    scale = HEAD_DIM**-0.5
    max_len = max(pool.lens)
    kv_tokens = case.shared + sum(n - case.shared for n in pool.lens)
    nbytes = 2 * kv_tokens * case.kv_heads * HEAD_DIM * 2 + 2 * q.numel() * 2
    args = (q, pool.k_cache, pool.v_cache, pool.block_tables, pool.seq_lens)
    row: dict = {"case": asdict(case), "mean_len": sum(pool.lens) / len(pool.lens), "bytes": nbytes}

    # -- pagedq: the public op (heuristic split count and config), eager and in a CUDA graph
    def public() -> torch.Tensor:
        return attn.paged_decode_attention(*args, scale, max_seq_len=max_len)

    out = public()
    row["auto_splits"] = paged_decode.choose_num_splits(
        case.batch, case.kv_heads, max_len, q.device
    )
    row["pagedq_us"] = time_us(public)
    try:
        row["pagedq_graph_us"] = float(triton.testing.do_bench_cudagraph(public, rep=40)) * 1e3
    except Exception as exc:
        row["pagedq_graph_us"] = f"{type(exc).__name__}: {exc}"[:120]

    # -- sweep: tile configs at the heuristic split count, then split counts at the best
    scratch = torch.empty_like(q)
    sweep: dict[str, float | str] = {}
    for bn, warps, stages in DECODE_CONFIGS:
        cfg = DecodeConfig(bn, warps, stages)
        run = lambda c=cfg: paged_decode.launch(*args, scratch, scale, row["auto_splits"], c)
        sweep[f"n{bn}/w{warps}/s{stages}/split{row['auto_splits']}"] = try_time_us(run)
    best_cfg = _best(sweep)
    bn, warps, stages = (int(x[1:]) for x in best_cfg.split("/")[:3])
    for splits in DECODE_SPLITS:
        run = lambda s=splits: paged_decode.launch(
            *args, scratch, scale, s, DecodeConfig(bn, warps, stages)
        )
        sweep[f"n{bn}/w{warps}/s{stages}/split{splits}"] = try_time_us(run)
    row["sweep_us"] = sweep
    row["best"] = _best(sweep)
    row["best_us"] = sweep[row["best"]]

    # -- peers ---------------------------------------------------------------------------
    row["sdpa_us"], ref = sdpa_decode(pool, case, q, scale)
    row["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
    for tensor_cores in (False, True):  # flashinfer's CUDA-core and tensor-core decode
        fi = flashinfer_decode(pool, case, q, scale, tensor_cores)
        key = "flashinfer_tc_us" if tensor_cores else "flashinfer_cuda_cores_us"
        row[key] = fi if isinstance(fi, str) else try_time_us(fi)
        if not isinstance(fi, str):
            row["max_abs_diff_vs_flashinfer"] = float((out.float() - fi().float()).abs().max())
        del fi
    peers = [row[k] for k in ("flashinfer_cuda_cores_us", "flashinfer_tc_us")]
    timed = [t for t in peers if isinstance(t, float)]
    row["flashinfer_us"] = min(timed) if timed else peers[0]  # the faster of the two
    for key in ("pagedq_us", "best_us", "flashinfer_us", "sdpa_us"):
        t = row[key]
        row[key.replace("_us", "_tbs")] = nbytes / t / 1e6 if isinstance(t, float) else None
    return row


def _best(sweep: dict[str, float | str]) -> str:
    timed = {key: t for key, t in sweep.items() if isinstance(t, float)}
    return min(timed, key=lambda key: timed[key])


def prefill_flops(case: PrefillCase) -> float:
    visible = sum(case.cached + r + 1 for r in range(case.new))  # keys seen, summed over rows
    return 4.0 * HEAD_DIM * visible * case.heads * case.seqs


def sdpa_prefill(case: PrefillCase, q: torch.Tensor, pool: PagedPool, scale: float):
    """SDPA (flash where it applies) on the same tokens laid out contiguously."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    qc = q.view(case.seqs, case.new, case.heads, HEAD_DIM).transpose(1, 2).contiguous()
    k, v, _ = contiguous_kv(pool)
    group = case.heads // case.kv_heads
    if case.cached == 0:
        gqa = lambda: F.scaled_dot_product_attention(
            qc, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = try_time_us(gqa)
        if isinstance(t, float):
            return t, "flash, enable_gqa"
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if case.cached == 0:
        call = lambda: F.scaled_dot_product_attention(qc, ke, ve, is_causal=True, scale=scale)
    else:
        bias = causal_lower_right(case.new, case.cached + case.new)
        call = lambda: F.scaled_dot_product_attention(qc, ke, ve, attn_mask=bias, scale=scale)
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for backends, label in (([SDPBackend.FLASH_ATTENTION], "flash"), (every, "any")):
        with sdpa_kernel(backends):
            t = try_time_us(call)
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
    row: dict = {"case": asdict(case), "flops": flops}
    public = lambda: attn.paged_prefill_attention(*args, scale)
    out = public()
    row["pagedq_us"] = time_us(public)
    scratch = torch.empty_like(q)
    sweep: dict[str, float | str] = {}
    for bm, bn, warps, stages in PREFILL_CONFIGS:
        cfg = PrefillConfig(bm, bn, warps, stages)
        run = lambda c=cfg: paged_prefill.launch(*args, scratch, scale, c)
        sweep[f"m{bm}/n{bn}/w{warps}/s{stages}"] = try_time_us(run)
    row["sweep_us"] = sweep
    row["best"] = _best(sweep)
    row["best_us"] = sweep[row["best"]]
    row["sdpa_us"], row["sdpa_backend"] = sdpa_prefill(case, q, pool, scale)
    ref = attn.reference_prefill_attention(*args[:6], scale) if case.seqs * total <= 8192 else None
    if ref is not None:
        row["max_abs_diff_vs_reference"] = float((out.float() - ref.float()).abs().max())
    for key in ("pagedq_us", "best_us", "sdpa_us"):
        t = row[key]
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
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": fi_version,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "dtype": str(DTYPE),
        "page_size": PAGE,
        "head_dim": HEAD_DIM,
    }


def _fmt(x: object, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else ("-" if x is None else str(x)[:24])


def markdown(env: dict, decode: list[dict], prefill: list[dict]) -> str:
    lines = [
        f"# Paged attention, {env['gpu']}, {env['date']}",
        "",
        f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
        f"flashinfer {env['flashinfer']}, Python {env['python']}; `{env['command']}`",
        "",
        "## Decode (bf16, page 16, head_dim 128); µs, TB/s of the 4.28 TB/s copy ceiling",
        "",
        "| case | pagedq | TB/s | graph | best swept | TB/s | config | flashinfer | TB/s "
        "| SDPA contiguous | target | flashinfer (targets.md) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in decode:
        c = r["case"]
        lines.append(
            f"| {c['name']} | {_fmt(r['pagedq_us'])} | {_fmt(r['pagedq_tbs'], 2)} "
            f"| {_fmt(r['pagedq_graph_us'])} | {_fmt(r['best_us'])} | {_fmt(r['best_tbs'], 2)} "
            f"| {r['best']} | {_fmt(r['flashinfer_us'])} | {_fmt(r['flashinfer_tbs'], 2)} "
            f"| {_fmt(r['sdpa_us'])} | {_fmt(c['target_us'])} | {_fmt(c['flashinfer_ref_us'])} |"
        )
    lines += [
        "",
        "## Prefill (bf16, 32/8 heads, head_dim 128); µs and TFLOP/s",
        "",
        "| case | pagedq | TFLOP/s | best swept | TFLOP/s | config | SDPA | TFLOP/s "
        "| SDPA backend | pagedq / SDPA | best / SDPA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in prefill:
        lines.append(
            f"| {r['case']['name']} | {_fmt(r['pagedq_us'])} | {_fmt(r['pagedq_tflops'])} "
            f"| {_fmt(r['best_us'])} | {_fmt(r['best_tflops'])} | {r['best']} "
            f"| {_fmt(r['sdpa_us'])} | {_fmt(r['sdpa_tflops'])} | {r['sdpa_backend']} "
            f"| {_fmt(r.get('pagedq_vs_sdpa'), 2)} | {_fmt(r.get('best_vs_sdpa'), 2)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    env = environment()
    print(json.dumps(env))
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    decode, prefill = [], []
    for case in DECODE_CASES:
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
    wins = sum(
        isinstance(r["flashinfer_us"], float) and r["pagedq_us"] <= r["flashinfer_us"]
        for r in decode
    )
    close = sum(r.get("pagedq_vs_sdpa", math.inf) <= 1.3 for r in prefill)
    print(
        f"summary: decode at or under flashinfer on {wins}/{len(decode)} cases; prefill within "
        f"1.3x of SDPA on {close}/{len(prefill)}; {time.time() - start:.0f}s; "
        f"results in {args.out}/attention_{stamp}.*"
    )


if __name__ == "__main__":
    main()
