"""The W4a stack's floor at M tokens: what any tensor-core W4a GEMV must do, and nothing else.

The M=16 W4a stack runs at the board's power limit (bench/results/gptq_w4a_2026-12-01k_notes.md),
and bench/mma_energy.py found a fp16 MAC's energy fixed by its data, whatever the instruction,
order or operand form. This script measures the bound that leaves. Each of the stack's 128 launches
(the W4a layers' qweight and scales, pagedq's own tensors, one CUDA graph, PDL) streams its bytes
in 16-byte loads, and for every weight word does the M-token products on the tensor cores:
- stream: the loads alone (XOR-ed), the bandwidth floor;
- hmma: fp16 mma.sync m16n8k16, f32 accumulators. A is the words' nibbles, masked into the fp16
  subnormals q * 2^-24 (an exact fp16 form that costs the same per MAC as q - 8:
  bench/results/mma_energy_2026-12-02.md), B is M tokens of N(0, 1) fp16 held in registers;
- imma: int8 mma.sync m16n8k32 on the raw nibbles, with 2 byte slices per token as B (16-bit
  activations as int8 need two), s32 accumulators.

No dequantization beyond one mask, no activation loads, no reduction; the sums are discarded.
So a W4a kernel doing those products on those instructions needs at least this probe's energy per
stack, and at the power limit at least its time. The script also times pagedq's own stack
(`ops.gptq_matmul`) in the same process, and prints per row the stack ms, TB/s, and the SM clock
and board power nvidia-smi samples while it replays.

    PYTHONPATH=. python3 bench/w4a_floor.py --ms 8,16 --log $OUT/w4a_floor.log
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gptq_stacks import (
    Stack,
    graphed,
    pagedq_stack,
    pagedq_weights,
    smi_query,
    time_ms,
    weight_bytes,
)
from cuda_ext.build import gencode

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
#include <cstdint>

constexpr int kUnroll = 4;  // 16-byte loads per thread in flight, twice over (double buffered)

__device__ inline void hmma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ inline void imma(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// kMode 0: stream; 1: hmma, kTiles tiles of 8 tokens; 2: imma, kTiles n8 tiles of byte slices.
// A thread's 16-byte word group of qweight is 32 nibbles: hmma takes them as 4 A fragments
// (nibble pairs 4s of each word), imma as 2 (low and high nibbles of each byte); each fragment
// meets every B tile once, so every nibble meets every token (slice) once.
template <int kMode, int kTiles>
struct Products {
  static constexpr int kFrags = kMode == 1 ? 4 : 2;
  float f[kFrags][kTiles][4] = {};
  int i[kFrags][kTiles][4] = {};
  uint32_t b[kTiles][2];

  __device__ void load_b(const uint32_t* bsrc) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      b[t][0] = bsrc[(lane * kTiles + t) * 2];
      b[t][1] = bsrc[(lane * kTiles + t) * 2 + 1];
    }
  }
  __device__ void add(const uint4& v) {
    if constexpr (kMode == 1) {
#pragma unroll
      for (int s = 0; s < kFrags; ++s) {
        const int sh = 4 * s;
        const uint32_t a0 = (v.x >> sh) & 0x000F000Fu, a1 = (v.y >> sh) & 0x000F000Fu;
        const uint32_t a2 = (v.z >> sh) & 0x000F000Fu, a3 = (v.w >> sh) & 0x000F000Fu;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) hmma(f[s][t], a0, a1, a2, a3, b[t][0], b[t][1]);
      }
    } else if constexpr (kMode == 2) {
#pragma unroll
      for (int s = 0; s < kFrags; ++s) {
        const int sh = 4 * s;
        const uint32_t a0 = (v.x >> sh) & 0x0F0F0F0Fu, a1 = (v.y >> sh) & 0x0F0F0F0Fu;
        const uint32_t a2 = (v.z >> sh) & 0x0F0F0F0Fu, a3 = (v.w >> sh) & 0x0F0F0F0Fu;
#pragma unroll
        for (int t = 0; t < kTiles; ++t) imma(i[s][t], a0, a1, a2, a3, b[t][0], b[t][1]);
      }
    }
  }
  __device__ float sum() const {
    float r = 0.0f;
#pragma unroll
    for (int s = 0; s < kFrags; ++s)
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) r += f[s][t][e] + static_cast<float>(i[s][t][e]);
    return r;
  }
};

// Grid-stride over nq qweight then ns scales 16-byte groups; products on the qweight ones.
template <int kMode, int kTiles>
__global__ void __launch_bounds__(256) floor_kernel(const uint4* __restrict__ qw, long long nq,
                                                    const uint4* __restrict__ sc, long long ns,
                                                    const uint32_t* __restrict__ bsrc,
                                                    unsigned* __restrict__ out) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long n = nq + ns, stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto fetch = [&](long long j) {
    return j < nq ? __ldcs(qw + j) : j < n ? __ldcs(sc + (j - nq)) : make_uint4(0, 0, 0, 0);
  };
  uint4 cur[kUnroll], nxt[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) cur[u] = fetch(i + u * stride);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  Products<kMode, kTiles> prod;
  if constexpr (kMode != 0) prod.load_b(bsrc);
  unsigned acc = 0;
  for (; i < n; i += kUnroll * stride) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) nxt[u] = fetch(i + (kUnroll + u) * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kMode != 0 && i + u * stride < nq) {
        prod.add(cur[u]);
      } else {
        acc ^= cur[u].x ^ cur[u].y ^ cur[u].z ^ cur[u].w;
      }
      cur[u] = nxt[u];
    }
  }
  if (acc == 0x12345678u || prod.sum() == 1.2345f) out[blockIdx.x] = acc;  // keeps the work
}

void launch(torch::Tensor qw, torch::Tensor sc, torch::Tensor bsrc, torch::Tensor out,
            int64_t ctas, int64_t mode, int64_t tiles) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas));
  cfg.blockDim = dim3(256);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const auto* q = reinterpret_cast<const uint4*>(qw.data_ptr());
  const auto* s = reinterpret_cast<const uint4*>(sc.data_ptr());
  const auto* b = reinterpret_cast<const uint32_t*>(bsrc.data_ptr<int32_t>());
  auto* o = reinterpret_cast<unsigned*>(out.data_ptr<int32_t>());
  const long long nq = qw.numel() * qw.element_size() / 16;
  const long long ns = sc.numel() * sc.element_size() / 16;
  using Kernel = void (*)(const uint4*, long long, const uint4*, long long, const uint32_t*,
                          unsigned*);
  constexpr Kernel kKernels[3][2] = {{floor_kernel<0, 1>, floor_kernel<0, 1>},
                                     {floor_kernel<1, 1>, floor_kernel<1, 2>},
                                     {floor_kernel<2, 2>, floor_kernel<2, 4>}};
  TORCH_CHECK(0 <= mode && mode < 3 && 1 <= tiles && tiles <= 2, "bad mode / tiles");
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kKernels[mode][tiles - 1], q, nq, s, ns, b, o));
}
"""

CPP = """
#include <torch/extension.h>
void launch(torch::Tensor qw, torch::Tensor sc, torch::Tensor bsrc, torch::Tensor out,
            int64_t ctas, int64_t mode, int64_t tiles);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("launch", &launch); }
"""

MODES = {"stream": 0, "hmma": 1, "imma": 2}


@dataclass(frozen=True)
class Row:
    """One probe: `mode` (MODES) at `m` tokens (a multiple of 8, at most 16), `per_sm` CTAs of
    256 threads per SM."""

    mode: str
    m: int
    per_sm: int

    @property
    def tiles(self) -> int:
        """Tiles of 8 tokens: the kernels' token-tile template index (imma doubles it inside)."""
        return 1 if self.mode == "stream" else self.m // 8

    @property
    def name(self) -> str:
        return "stream" if self.mode == "stream" else f"{self.mode}, M={self.m}"


def rows_for(ms: list[int], per_sm: list[int]) -> list[Row]:
    """The stream row, then hmma and imma at each M, each at every CTA count."""
    bad = [m for m in ms if m not in (8, 16)]
    if bad:
        raise ValueError(f"--ms takes 8 and 16 only (tiles of 8 tokens), got {bad}")
    if not all(1 <= c <= 8 for c in per_sm):
        raise ValueError(f"--ctas-per-sm takes 1..8 (the output words per SM), got {per_sm}")
    return [
        Row(mode, m, c)
        for mode, m in [("stream", 0), *[(md, m) for m in ms for md in ("hmma", "imma")]]
        for c in per_sm
    ]


def b_operands(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """B words per lane and tile, [32 lanes * 4 tiles * 2] int32: N(0, 1) fp16 pairs for hmma,
    uniform s8 quads for imma (the byte slices of 16-bit activations)."""
    fp16 = torch.randn(32 * 4 * 2 * 2, generator=gen).half().view(torch.int32)
    s8 = torch.randint(-128, 128, (32 * 4 * 2 * 4,), generator=gen, dtype=torch.int8)
    return {"hmma": fp16, "imma": s8.view(torch.int32), "stream": fp16}


def build():  # type: ignore[no-untyped-def]
    from torch.utils import cpp_extension

    return cpp_extension.load_inline(
        name="pagedq_w4a_floor",
        cpp_sources=CPP,
        cuda_sources=SOURCE,
        extra_cuda_cflags=["-O3", gencode(torch.cuda.get_device_capability())],
        build_directory=tempfile.mkdtemp(prefix="w4a_floor_"),
        verbose=False,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16", help="token counts (8, 16), comma-separated")
    ap.add_argument("--ctas-per-sm", default="1,2", help="CTAs of 256 threads per SM to try")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--clocks", type=float, default=2.0, help="seconds of nvidia-smi sampling")
    ap.add_argument("--log", type=Path)
    args = ap.parse_args(argv)
    rows = rows_for(
        [int(v) for v in args.ms.split(",")], [int(v) for v in args.ctas_per_sm.split(",")]
    )
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    ext = build()
    props = torch.cuda.get_device_properties(0)
    weights = pagedq_weights()
    nbytes = weight_bytes(weights)
    bsrc = {k: v.cuda() for k, v in b_operands(torch.Generator().manual_seed(0)).items()}
    out = torch.zeros(props.multi_processor_count * 8, dtype=torch.int32, device="cuda")
    idle = smi_query("power.draw")
    lines = [
        f"# {props.name}, torch {torch.__version__}; bench/w4a_floor.py " + " ".join(sys.argv[1:]),
        f"stack bytes {nbytes / 1e9:.3f} GB; idle board power "
        f"{idle[0] if idle else float('nan'):.0f} W",
        "| probe | CTAs/SM | stack ms | TB/s | SM MHz | board W | J per stack |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def measure(name: str, per_sm: str, stack: Stack) -> None:
        replay = graphed(stack)
        ms = min(time_ms(replay, args.repeats) for _ in range(3))
        smi = smi_query("clocks.sm,power.draw", args.clocks, replay) if args.clocks else None
        mhz, watts = (smi[0], smi[1]) if smi else (float("nan"), float("nan"))
        lines.append(
            f"| {name} | {per_sm} | {ms:.3f} | {nbytes / ms / 1e9:.2f} | {mhz:.0f} | "
            f"{watts:.0f} | {watts * ms / 1e3:.3f} |"
        )
        print(lines[-1], flush=True)

    for row in rows:
        ctas = props.multi_processor_count * row.per_sm

        def stack(row: Row = row, ctas: int = ctas) -> None:
            mode, b = MODES[row.mode], bsrc[row.mode]
            for w in weights:
                ext.launch(w.qweight, w.scales, b, out, ctas, mode, row.tiles)

        measure(row.name, str(row.per_sm), stack)
    for m in sorted({r.m for r in rows if r.m}):
        measure(f"pagedq ops.gptq_matmul, M={m}", "-", pagedq_stack(weights, m))
    text = "\n".join(lines)
    print(text)
    if args.log:
        args.log.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
