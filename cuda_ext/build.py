"""Build and load pagedq's CUDA extension on first use, registering its torch custom ops.

Layering: templated raw-pointer kernels in `*.cuh` <- a thin torch-facing `.cu` per op (checks,
device guard, current stream) <- `bindings.cpp`, which registers the ops as `pagedq::*` with
torch.library. The fake (meta) kernels are registered here, so the ops work under
torch.compile and inside CUDA-graph captures.

The build uses `torch.utils.cpp_extension.load` with only the current device's architecture
(`-gencode=arch=compute_90a,code=sm_90a` on an H100/H200: the GEMM's wgmma needs the
architecture-specific target), MAX_JOBS parallel jobs (default: the
CPU count, at most 8), and caches its output under `$PAGEDQ_CACHE_DIR/cuda_ext` (default
`~/.cache/pagedq/cuda_ext`), one folder per torch / CUDA / architecture. If nvcc or the GPU is
missing, or the build fails, `gptq_ext_available` returns False and warns once per process.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

SOURCES = ("gptq_gemv.cu", "gptq_gemm.cu", "bindings.cpp")  # the one source list
EXTENSION_NAME = "pagedq_cuda_ext"
MIN_CAPABILITY = (8, 0)  # bf16 pair arithmetic

_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded": outcome of the one build attempt of this process


def cache_dir() -> Path:
    """Where built extensions are cached ($PAGEDQ_CACHE_DIR or ~/.cache/pagedq)."""
    root = os.environ.get("PAGEDQ_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pagedq")
    return Path(root) / "cuda_ext"


def gptq_ext_available(device: torch.device) -> bool:
    """True when the extension's ops (`torch.ops.pagedq.gptq_gemv`, and on sm_90
    `torch.ops.pagedq.gptq_gemm`) can run on `device` (builds them on the first call)."""
    if device.type != "cuda":
        return False
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _try_load(device)
    return _state["loaded"]


def _try_load(device: torch.device) -> bool:
    try:
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise RuntimeError(f"compute capability {capability} < {MIN_CAPABILITY}")
        _build(capability)
        _register_fakes()
    except Exception as exc:  # any failure means "use Triton"; say why once
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        warnings.warn(
            f"pagedq: CUDA extension unavailable ({reason}); GPTQ small-M matmuls use Triton",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def arch_name(capability: tuple[int, int]) -> str:
    """The device's nvcc architecture: "90a" on Hopper (wgmma, TMA and setmaxnreg need the
    arch-specific target), else e.g. "80"."""
    return f"{capability[0]}{capability[1]}" + ("a" if capability == (9, 0) else "")


def gencode(capability: tuple[int, int]) -> str:
    """nvcc's flag that builds for exactly this device."""
    arch = arch_name(capability)
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def load_probe(name: str, cpp_sources: str, cuda_sources: str) -> Any:
    """A bench probe's inline extension (bench/mma_energy.py, bench/w4a_floor.py), built for the
    current device with -O3 into a fresh temporary directory, with cuda_ext/ on the include path
    so that a probe can use the ops' host helpers (gptq_host.h)."""
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name=name,
        cpp_sources=cpp_sources,
        cuda_sources=cuda_sources,
        extra_cuda_cflags=["-O3", gencode(torch.cuda.get_device_capability())],
        extra_include_paths=[str(Path(__file__).resolve().parent)],
        build_directory=tempfile.mkdtemp(prefix=f"{name}_"),
        verbose=False,
    )


def _build(capability: tuple[int, int]) -> None:
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("nvcc not found (CUDA_HOME unset)")
    arch = arch_name(capability)
    tag = re.sub(
        r"[^A-Za-z0-9_.]", "_", f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch}"
    )
    build_dir = cache_dir() / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(min(8, os.cpu_count() or 1)))
    here = Path(__file__).resolve().parent
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(here / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", gencode(capability), "-lineinfo"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )


def _register_fakes() -> None:
    """Shape-only kernels for torch.compile / meta tensors."""

    def out_like(x: torch.Tensor, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
        """Both ops return [M, N] in x's dtype (x [M, K], qweight [Kp/8, N])."""
        return x.new_empty((x.shape[0], qweight.shape[1]))

    for op in ("gptq_gemv", "gptq_gemm"):
        torch.library.register_fake(f"pagedq::{op}", out_like)
