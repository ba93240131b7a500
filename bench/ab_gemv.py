"""A/B harness for the CUDA GEMV (cuda_ext/gptq_gemv.cuh): builds several versions of it side by
side in one process, checks each against the torch reference, then times the W4a stack with them
interleaved, so that every figure of a comparison comes from the same process and GPU state.

A version is NAME=DIR, DIR a copy of cuda_ext/ (gptq_gemv.cu, gptq_gemv.cuh, gptq_host.h), or
NAME=FILE.diff, a diff against this tree's cuda_ext/gptq_gemv.cuh, or NAME=A.diff+B.diff, diffs
applied in that order; e.g. the working tree's `cuda_ext` and a copy of the last commit's
(versions named probe... are timed but not checked: builds with parts of the work taken out):

    mkdir -p .dev/cur && git archive HEAD cuda_ext | tar -x -C .dev/cur
    PYTHONPATH=. python3 bench/ab_gemv.py cur=.dev/cur/cuda_ext new=cuda_ext --ms 1,8,16

Each version is built as its own extension (ops `ab_NAME::gptq_gemv`, with its own workspace),
with the flags of cuda_ext/build.py. The check runs every version over fp16/bf16, M = 1, 2, 5, 8,
9, 12 and 16, four shapes (K = 4096, 11008, 4160, 256), g128 and g64, with and without zero
points, bias on odd M: each result must be within the tolerance of the reference, be the same bits
when asked twice, and leave the workspace all -1. Timing: the bench's 128 launches (32 layers of
qkv / o / gate_up / down, g128 sym, fp16) in one CUDA graph, median of 20 replays, per version and
M, over --rounds rounds that alternate the versions; then µs per launch of each shape (32
same-shape launches in one graph); with --clocks, the SM clock and board power during each stack.
The weights' nibbles are uniform, as in the bench, or with --nibbles gptq distributed as a real
checkpoint's (--nibbles uniform,gptq times each version on both).
Prints one table; --log writes it to a file too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gptq_stacks import (
    LAYERS,
    SHAPES,
    graphed,
    inputs,
    pagedq_weights,
    smi_query,
    time_ms,
)
from cuda_ext.build import gencode
from pagedq.ops import gptq as ops
from pagedq.ops.gptq import PackedGPTQWeight

SOURCES = ("gptq_gemv.cu", "gptq_gemv.cuh", "gptq_host.h")
CHECK_MS = (1, 2, 5, 8, 9, 12, 16)
CHECK_SHAPES = ((4096, 4096), (11008, 1024), (4160, 640), (256, 72))
Op = Callable[..., torch.Tensor]

BINDINGS = """
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <optional>
namespace pagedq {
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size);
}
TORCH_LIBRARY(ab_NAME, m) {
  m.def("gptq_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
        "Tensor(a!) workspace, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(ab_NAME, CUDA, m) { m.impl("gptq_gemv", &pagedq::gptq_gemv_cuda); }
"""


def patches_of(src: Path) -> list[Path] | None:
    """The diffs of a version spec A.diff or A.diff+B.diff+... (applied in order to this tree's
    cuda_ext/gptq_gemv.cuh), or None for a cuda_ext copy."""
    parts = [Path(part) for part in str(src).split("+")]
    return parts if all(part.suffix == ".diff" for part in parts) else None


def build(name: str, src: Path, root: Path) -> Op:
    """Compile version `name` from `src` (a cuda_ext copy, or diffs against this tree's
    cuda_ext/gptq_gemv.cuh: patches_of) into root/name; returns its op."""
    from torch.utils import cpp_extension

    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
        raise SystemExit(f"version name {name!r}: letters, digits and _ only")
    work = root / name
    work.mkdir(parents=True, exist_ok=True)
    patches = patches_of(src)
    base = Path(__file__).resolve().parent.parent / "cuda_ext" if patches is not None else src
    for f in SOURCES:
        shutil.copy(base / f, work / f)
    for diff in patches or []:
        patch = ["patch", "-s", str(work / "gptq_gemv.cuh"), str(diff.resolve())]
        subprocess.run(patch, check=True)
    (work / "ab_bind.cpp").write_text(BINDINGS.replace("NAME", name))
    cpp_extension.load(
        name=f"ab_{name}",
        sources=[str(work / "gptq_gemv.cu"), str(work / "ab_bind.cpp")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", gencode(torch.cuda.get_device_capability()), "-lineinfo"],
        build_directory=str(work),
        is_python_module=False,
        verbose=False,
    )
    return getattr(torch.ops, f"ab_{name}").gptq_gemv  # type: ignore[no-any-return]


def workspace() -> torch.Tensor:
    return torch.full_like(ops.cuda_workspace(torch.device("cuda")), -1)


def random_weight(k: int, n: int, group: int, zeros: bool, dtype: torch.dtype) -> PackedGPTQWeight:
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32)
    scales = torch.rand(groups, n) * 0.02 + 0.001
    z = torch.randint(0, 17, (groups, n)) if zeros else torch.full((groups, n), 8)
    return ops.make_packed_weight(q, scales, z, group, None, dtype, "cuda")


def check(versions: dict[str, Op]) -> list[str]:
    """Run every version over the check cases; returns one line per failure."""
    bad: list[str] = []
    spaces = {name: workspace() for name in versions}
    cases = 0
    differ = dict.fromkeys(versions, 0)  # cases whose bits differ from the first version's
    for dtype in (torch.float16, torch.bfloat16):
        for k, n in CHECK_SHAPES:
            for group in (128, 64):
                for zeros in (False, True):
                    w = random_weight(k, n, group, zeros, dtype)
                    for m in CHECK_MS:
                        x = torch.randn(m, k, device="cuda", dtype=dtype)
                        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
                        ref = ops.gptq_matmul_reference(x, w, bias).float()
                        scale = float(ref.abs().max()) or 1.0
                        tol = 1e-2 if dtype == torch.float16 else 3e-2
                        first: torch.Tensor | None = None
                        for name, op in versions.items():
                            ws = spaces[name]
                            args = (x, w.qweight, w.scales, w.zeros, bias, ws, w.group_size)
                            got, again = op(*args), op(*args)
                            torch.cuda.synchronize()
                            if first is None:
                                first = got
                            elif not torch.equal(got, first):
                                differ[name] += 1
                            err = float((got.float() - ref).abs().max()) / scale
                            where = f"{name} {dtype} M={m} K={k} N={n} g{group} z={zeros}"
                            if not err <= tol:
                                bad.append(f"{where}: error {err:.3g} > {tol}")
                            if not torch.equal(got, again):
                                bad.append(f"{where}: not the same bits twice")
                            if not bool((ws == -1).all()):
                                bad.append(f"{where}: workspace not left empty")
                                ws.fill_(-1)
                        cases += 1
    print(f"check: {cases} cases x {len(versions)} versions, {len(bad)} bad", flush=True)
    others = list(versions)[1:]
    if others:
        print(
            "bits differ from the first version in: "
            + ", ".join(f"{name} {differ[name]} cases" for name in others),
            flush=True,
        )
    return bad


def stack(op: Op, weights: list[PackedGPTQWeight], m: int, ws: torch.Tensor) -> Callable[[], None]:
    xs = inputs(m, torch.float16)

    def run() -> None:
        for w in weights:
            op(xs[w.in_features], w.qweight, w.scales, w.zeros, None, ws, w.group_size)

    return graphed(run)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "versions",
        nargs="+",
        help="NAME=DIR (a copy of cuda_ext/), NAME=FILE.diff or NAME=A.diff+B.diff",
    )
    parser.add_argument("--ms", default="1,8,16", help="token counts to time, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-check", action="store_true", help="timing only (probes)")
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument(
        "--clocks", type=float, default=0.0, help="also replay each stack this many seconds while "
        "nvidia-smi samples the SM clock and the board power",
    )  # fmt: skip
    parser.add_argument(
        "--nibbles", default="uniform", help="the weights' nibbles, comma-separated: uniform over "
        "0..15, gptq (distributed as a real checkpoint's: gptq_stacks.gptq_like_q), or both; "
        "with both, each version is timed on each as NAME/NIBBLES",
    )  # fmt: skip
    parser.add_argument("--build-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    specs = [spec.partition("=")[::2] for spec in args.versions]
    if args.build_only is not None:  # one version, in a process of its own (see below)
        build(specs[0][0], Path(specs[0][1]), args.build_only)
        return
    torch.manual_seed(0)
    # every version compiles in a process of its own, all at once; loading them here then finds
    # the builds up to date
    root = Path(tempfile.mkdtemp(prefix="ab_gemv_"))
    env = dict(os.environ, MAX_JOBS="2")
    builders = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.ab_gemv", f"{n}={d}", "--build-only", str(root)], env=env
        )
        for n, d in specs
    ]
    if any(b.wait() != 0 for b in builders):
        raise SystemExit("a build failed")
    versions = {name: build(name, Path(path), root) for name, path in specs}
    print(f"built {', '.join(versions)}", flush=True)
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; " + " ".join(sys.argv)]
    if not args.no_check:  # probes (timing only) are versions named probe*
        bad = check({n: op for n, op in versions.items() if not n.startswith("probe")})
        lines.append(f"check: {len(bad)} bad")
        lines += bad[:20]
    nibbles = args.nibbles.split(",")
    if not set(nibbles) <= {"uniform", "gptq"}:
        raise SystemExit(f"--nibbles: {args.nibbles!r} is not uniform, gptq or both")
    weight_sets = {d: pagedq_weights(d) for d in nibbles}
    spaces = {name: workspace() for name in versions}
    runs = {  # label -> (op, weights, workspace)
        (f"{name}/{d}" if len(nibbles) > 1 else name): (op, weight_sets[d], spaces[name])
        for name, op in versions.items()
        for d in nibbles
    }
    ms = [int(v) for v in args.ms.split(",")]
    stacks = {(label, m): stack(op, w, m, ws) for label, (op, w, ws) in runs.items() for m in ms}
    per_shape = {
        (label, m, i): stack(op, w[i :: len(SHAPES)], m, ws)
        for label, (op, w, ws) in runs.items()
        for m in ms
        for i in range(len(SHAPES))
    }
    times: dict[tuple[str, int], list[float]] = {key: [] for key in stacks}
    for _ in range(args.rounds):
        for key, fn in stacks.items():
            times[key].append(time_ms(fn, args.repeats))
    lines.append(
        "| M | version | stack ms (rounds) | " + " / ".join(s for s, _, _ in SHAPES) + " µs |"
    )
    lines.append("| --- | --- | --- | --- |")
    for m in ms:
        for name in runs:
            ts = times[(name, m)]
            layer = [
                time_ms(per_shape[(name, m, i)], args.repeats) * 1000 / LAYERS
                for i in range(len(SHAPES))
            ]
            rounds = " ".join(f"{t:.3f}" for t in ts)
            per = " / ".join(f"{v:.1f}" for v in layer)
            lines.append(f"| {m} | {name} | {statistics.median(ts):.3f} ({rounds}) | {per} |")
    if args.clocks > 0:
        lines += ["", "| M | version | SM MHz | board W |", "| --- | --- | --- | --- |"]
        for m in ms:
            for name in runs:
                got = smi_query("clocks.sm,power.draw", args.clocks, stacks[(name, m)])
                cells = f"{got[0]:.0f} | {got[1]:.0f}" if got is not None else "– | –"
                lines.append(f"| {m} | {name} | {cells} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.log is not None:
        args.log.write_text(text + "\n")


if __name__ == "__main__":
    main()
