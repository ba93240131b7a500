"""Triton kernels compiled for an H100/H200 (sm_90) where no GPU is present.

The interpreter does not type-check like the compiler (it takes Python-int globals that the
compiler refuses), so the kernels are also compiled, in a fresh process where Triton is not
interpreting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SEPARATOR = "\n=== next kernel ===\n"


def run_compiler(code: str) -> str:
    """Run Python `code` in a fresh process with Triton compiling; its stdout. Skips without
    Triton's NVIDIA backend; fails with the end of stderr when the code fails."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def sm90_ptx(
    module: str, kernels: list[tuple[str, dict[str, str], dict[str, Any], int]]
) -> list[str]:
    """The PTX of each (kernel name, signature of its runtime arguments, constexpr values,
    num_warps) of `module`, compiled for sm_90 in one fresh process."""
    code = [
        "import sys, triton",
        "from triton.backends.compiler import GPUTarget",
        "from triton.compiler import ASTSource",
        f"import {module} as m",
        "texts = []",
    ]
    for name, signature, consts, num_warps in kernels:
        code += [
            f"k = m.{name}",
            f"sig = {{**{signature!r}, **{{c: 'constexpr' for c in {list(consts)!r}}}}}",
            f"consts = {{(k.arg_names.index(c),): v for c, v in {consts!r}.items()}}",
            "c = triton.compile(ASTSource(k, sig, consts), target=GPUTarget('cuda', 90, 32),"
            f" options={{'num_warps': {num_warps}}})",
            "texts.append(c.asm['ptx'])",
        ]
    code.append(f"sys.stdout.write({_SEPARATOR!r}.join(texts))")
    return run_compiler("\n".join(code)).split(_SEPARATOR)
