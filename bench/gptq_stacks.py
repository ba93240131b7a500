"""The W4a stacks: the 224 GPTQ linears of a Llama-2-7B decode step as pagedq, dense fp16,
aten int4 (tinygemm) and Marlin (GPTQModel) run them, and the CUDA-event / CUDA-graph timers.
Conditions are in bench/bench_gptq.py, which measures them.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from pagedq.ops import gptq as ops
from pagedq.ops.gptq import PackedGPTQWeight

LAYERS = 32
GROUP = 128
SHAPES = (("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096))
Stack = Callable[[], None]


def time_ms(fn: Stack, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def smi_device() -> str:
    """nvidia-smi's id of torch's current GPU: its UUID ("GPU-..."), since nvidia-smi numbers the
    GPUs of the host and ignores CUDA_VISIBLE_DEVICES; "0" without CUDA or a UUID."""
    if torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        if uuid is not None:
            return f"GPU-{uuid}"
    return "0"


def smi_query(fields: str, seconds: float = 0.0, fn: Stack | None = None) -> list[float] | None:
    """nvidia-smi's values of `fields` (e.g. "clocks.sm,power.draw") for torch's current GPU
    (`smi_device`): read once, or, with `fn`, sampled every 50 ms while `fn` runs back to back for
    `seconds`, each field's median past the first quarter of the samples (warmed up). None without
    nvidia-smi or samples.

    The W4a stacks run at the board's power limit from M = 8 on (H200, 700 W): the SM clock then
    falls below its maximum, and the time follows the energy a stack takes rather than its
    latency (bench/results/gptq_w4a_2026-12-01k_notes.md)."""
    cmd = [
        "nvidia-smi",
        "-i",
        smi_device(),
        f"--query-gpu={fields}",
        "--format=csv,noheader,nounits",
    ]
    try:
        if fn is None:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        else:
            smi = subprocess.Popen([*cmd, "-lms", "50"], stdout=subprocess.PIPE, text=True)
            try:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
            finally:  # the sampler stops even if `fn` fails
                smi.terminate()
                out, _ = smi.communicate()
    except (OSError, subprocess.CalledProcessError):
        return None
    samples = []
    for line in out.splitlines():
        try:
            samples.append([float(v) for v in line.split(",")])
        except ValueError:  # "[N/A]" and the like
            continue
    tail = samples[len(samples) // 4 :]
    if not tail:
        return None
    return [statistics.median(s[i] for s in tail) for i in range(len(tail[0]))]


def graphed(fn: Stack) -> Stack:
    """`fn` captured once in a CUDA graph (after a warm-up on a side stream); returns replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def inputs(m: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    return {k: torch.randn(m, k, device="cuda", dtype=dtype) for k in (4096, 11008)}


# --- the stacks ---------------------------------------------------------------------------


def gptq_like_q(k: int, n: int, spread: float = 2.7) -> torch.Tensor:
    """q [k, n] drawn as a symmetric 4-bit GPTQ checkpoint's values are distributed:
    round(8 + spread * N(0, 1)) clipped to 0..15. With scale = max |w| / 7.5 per 128-row group of
    Gaussian weights, max |w| is about 2.8 sigma: q - 8 has a spread near 2.7."""
    return (torch.randn(k, n, device="cuda") * spread + 8).round_().clamp_(0, 15).to(torch.int32)


def pagedq_weights(nibbles: str = "uniform") -> list[PackedGPTQWeight]:
    """The stack's weights: every nibble uniform over 0..15 (the bench's default), or
    `nibbles="gptq"`, distributed as a real checkpoint's (gptq_like_q). At the board's power limit
    a stack's time could depend on its data; the weights' distribution does not change it (H200,
    bench/results/gptq_w4a_2026-12-01l_notes.md)."""
    weights = []
    for _ in range(LAYERS):
        for _, k, n in SHAPES:
            if nibbles == "gptq":
                qweight = ops.pack_blocks(gptq_like_q(k, n))
            else:  # random words: 16 word rows per 128-row block
                rows = -(-k // ops.BLOCK_K) * 16
                qweight = torch.randint(
                    -(2**31), 2**31 - 1, (rows, n), dtype=torch.int32, device="cuda"
                )
            weights.append(
                PackedGPTQWeight(
                    qweight=qweight,
                    scales=(torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).half(),
                    zeros=None,
                    perm=None,
                    locks=torch.zeros(
                        max(n // 16, ops.MIN_LOCKS), dtype=torch.int32, device="cuda"
                    ),
                    in_features=k,
                    out_features=n,
                    group_size=GROUP,
                )
            )
    return weights


def weight_bytes(weights: list[PackedGPTQWeight]) -> int:
    return sum(w.qweight.numel() * 4 + w.scales.numel() * 2 for w in weights)


def pagedq_stack(
    weights: list[PackedGPTQWeight], m: int, call: Callable[..., Any] | None = None
) -> Stack:
    xs = inputs(m, weights[0].dtype)  # the scales' dtype: fp16, or bf16 for the bf16 rows
    matmul = call or ops.gptq_matmul

    def run() -> None:
        for w in weights:
            matmul(xs[w.in_features], w)

    return run


def dense_weights() -> list[torch.Tensor]:
    return [
        torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        for _ in range(LAYERS)
        for _, k, n in SHAPES
    ]


def dense_stack(weights: list[torch.Tensor], m: int) -> Stack:
    xs = inputs(m, torch.float16)

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    return run


def tinygemm_layers() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """aten int4 weights (bf16 scales and zeros), one per linear; raises if this torch's
    signatures differ (they changed across versions)."""
    layers = []
    for _, k, n in SHAPES * LAYERS:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        packed_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        w = torch._convert_weight_to_int4pack(packed_u8, 8)
        sz = torch.empty(k // GROUP, n, 2, device="cuda", dtype=torch.bfloat16)
        sz[..., 0].uniform_(0.001, 0.01)
        sz[..., 1].zero_()
        torch._weight_int4pack_mm(
            torch.randn(1, k, device="cuda", dtype=torch.bfloat16), w, GROUP, sz
        )
        layers.append((w, sz, k))
    return layers


def tinygemm_stack(layers: list[tuple[torch.Tensor, torch.Tensor, int]], m: int) -> Stack:
    xs = inputs(m, torch.bfloat16)

    def run() -> None:
        for w, sz, k in layers:
            torch._weight_int4pack_mm(xs[k], w, GROUP, sz)

    return run


def marlin_class() -> tuple[Any, dict[str, Any]]:
    """GPTQModel's Marlin linear (renamed MarlinLinear in 7.6) and the extra constructor kwargs."""
    import inspect

    from gptqmodel.nn_modules.qlinear import marlin  # type: ignore[import-not-found]

    cls = getattr(marlin, "MarlinLinear", None) or marlin.MarlinQuantLinear
    params = inspect.signature(cls.__init__).parameters
    extra = {"register_buffers": True} if "register_buffers" in params else {}
    return cls, extra


def marlin_layers() -> list[torch.nn.Module]:
    cls, extra = marlin_class()
    layers = []
    for _ in range(LAYERS):
        for _, k, n in SHAPES:
            lin = cls(
                bits=4,
                group_size=GROUP,
                desc_act=False,
                sym=True,
                in_features=k,
                out_features=n,
                bias=False,
                **extra,
            )
            lin = lin.to("cuda")
            lin.qweight.data = torch.randint(
                -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda"
            )
            lin.scales.data = (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).half()
            lin.qzeros.data = torch.full(
                (k // GROUP, n // 8), 0x77777777, dtype=torch.int32, device="cuda"
            )
            lin.g_idx.data = (torch.arange(k, device="cuda") // GROUP).int()
            lin.post_init()
            layers.append(lin)
    return layers


def module_stack(layers: list[torch.nn.Module], m: int) -> Stack:
    xs = inputs(m, torch.float16)

    def run() -> None:
        for lin in layers:
            lin(xs[cast(int, lin.in_features)])

    return run
