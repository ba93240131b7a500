"""Choosing between a Triton kernel and its reference, and importing kernel modules.

Ops whose kernels are all Triton (attention, the fused layer ops) read their backend from an
environment variable per call: `auto` (Triton on CUDA tensors, the reference on CPU tensors),
`triton` (on CPU tensors through the Triton interpreter) or `torch` (the reference). Kernel
modules are imported on first use, in the interpreter when the tensors are on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from types import ModuleType
from typing import Literal

import torch

from pagedq.errors import ConfigError

BACKENDS = ("auto", "triton", "torch")


def env_backend(env: str, device: torch.device) -> Literal["triton", "torch"]:
    """The backend environment variable `env` selects for tensors on `device`."""
    value = os.environ.get(env, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ConfigError(f"{env}={os.environ[env]!r} is not a backend; choose one of {BACKENDS}")
    if value == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return "triton" if value == "triton" else "torch"


def launch_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A context that makes `device` the current CUDA device (nothing for CPU devices).

    Triton launches on the current device, whatever the tensors' device, so every forward over
    a model on `cuda:N` runs inside this (the CUDA extension sets its own guard).
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def load_kernels(
    module_name: str, device: torch.device, companions: tuple[str, ...] = ()
) -> ModuleType:
    """The kernel module `module_name`, imported in the Triton interpreter when run on CPU
    tensors. `companions`: modules whose kernels it launches too (checked alike)."""
    module = sys.modules.get(module_name)
    on_cpu = device.type == "cpu"
    if module is None:
        if on_cpu:
            os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit when the module loads
        module = importlib.import_module(module_name)
    if on_cpu and not _is_interpreted((module_name, *companions)):
        raise ConfigError(
            f"{module_name} was compiled for the GPU earlier in this process, so it cannot run "
            "on CPU tensors; set TRITON_INTERPRET=1 before the first kernel call"
        )
    return module


@functools.cache
def _is_interpreted(names: tuple[str, ...]) -> bool:
    """Whether every kernel of the imported modules `names` is interpreted; fixed once they are
    imported."""
    from triton.runtime.interpreter import InterpretedFunction

    kernels = [
        obj for name in names if name in sys.modules for obj in vars(sys.modules[name]).values()
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
    ]  # fmt: skip
    return all(isinstance(fn, InterpretedFunction) for fn in kernels)
