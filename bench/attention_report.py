"""W4b bench reporting: the run's environment, the markdown tables and the one-line summary.

Used by bench/bench_attention.py; rows are the dicts its case functions return.
"""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

import torch
import triton

from bench.attention_cases import DTYPE, HEAD_DIM, PAGE, Timing


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
