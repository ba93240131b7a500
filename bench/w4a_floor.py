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
--paths adds parts of the GEMV one at a time (PATHS): the weights through a shared-memory ring,
the activations copied and read as the GEMV does at 16 tokens, its q - 8 subtraction (in its own
instructions), its per-block scale, its warp pairs' barrier, and x copied only after the PDL wait.
--threads sets the CTA size, so --ctas-per-sm 3 --threads 128 has pagedq's 12 warps per SM. The
probe is an estimate of the floor, not a proof: it has overheads of its own (its stream alone
runs below the best read-only kernel's rate). The script also times pagedq's own stack
(`ops.gptq_matmul`) in the same process, and prints per row the stack ms, TB/s, the SM clock and
board power nvidia-smi samples while it replays, and µs per launch of each layer shape (time per
launch against time per byte).

    PYTHONPATH=. python3 bench/w4a_floor.py --ms 16 --ctas-per-sm 2 --paths none,ring+x
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gptq_stacks import (
    LAYERS,
    SHAPES,
    Stack,
    graphed,
    pagedq_stack,
    pagedq_weights,
    smi_query,
    time_ms,
    weight_bytes,
)
from cuda_ext.build import load_probe
from pagedq.ops.gptq import PackedGPTQWeight

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/extension.h>
#include <cstdint>

#include "gptq_host.h"  // cuda_ext/: launch (with PDL)

constexpr int kUnroll = 4;  // 16-byte groups per thread per round
constexpr int kStages = 3;  // shared-memory rounds: one read, two in flight
constexpr int kThreads = 256;  // at most; a launch may take fewer (its rings shrink with it)

__device__ inline __half2 as_h2(uint32_t bits) { return *reinterpret_cast<__half2*>(&bits); }
__device__ inline uint32_t as_u32(__half2 pair) { return *reinterpret_cast<uint32_t*>(&pair); }

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

// (bits & kMask) | 1024 in both fp16 halves, one LOP3.
template <uint32_t kMask>
__device__ inline uint32_t magic_pair(uint32_t bits) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "n"(kMask), "r"(0x64006400u));
  return out;
}

// 16 bytes global -> shared; src_bytes 0 zero-fills (src must still be a valid address).
__device__ inline void cp_async16(uint4* dst, const uint4* src, int src_bytes) {
  const auto d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// kMode 0: stream; 1: hmma, kTiles tiles of 8 tokens; 2: imma, kTiles n8 tiles of byte slices.
// A thread's 16-byte word group of qweight is 32 nibbles: hmma takes them as 4 A fragments
// (nibble pairs 4s of each word), imma as 2 (low and high nibbles of each byte); each fragment
// meets every B tile once, so every nibble meets every token (slice) once. B is either fixed
// per lane (load_b) or, with the activations' path, the 32 bytes xa, xb read for the group:
// tile t takes words 2(s % 2), + 1 of xa (t even) or xb, so each word meets two fragments, as
// the GEMV's x registers do.
template <int kMode, int kTiles>
struct Products {
  static constexpr int kFrags = kMode == 1 ? 4 : 2;
  float f[kFrags][kTiles][4] = {};
  int i[kFrags][kTiles][4] = {};
  float total[kFrags][kTiles][4] = {};
  uint32_t b[kTiles][2];

  __device__ void load_b(const uint32_t* bsrc) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      b[t][0] = bsrc[(lane * kTiles + t) * 2];
      b[t][1] = bsrc[(lane * kTiles + t) * 2 + 1];
    }
  }
  template <bool kX, bool kSub>
  __device__ void add(const uint4& v, const uint4& xa, const uint4& xb) {
    constexpr uint32_t kMask = kMode == 1 ? 0x000F000Fu : 0x0F0F0F0Fu;
    auto operand = [&](uint32_t word, int s) {
      if constexpr (kSub && kMode == 1) {
        // the GEMV's exact q - 8, in its instructions (gptq_gemv.cuh, compute): one LOP3 makes
        // 1024 + q (even pairs) or 1024 + 16 q (odd pairs, no shift), then one HSUB2 or HFMA2
        const uint32_t src = s >= 2 ? word >> 8 : word;
        if (s % 2 == 0) return as_u32(__hsub2(as_h2(magic_pair<0x000F000F>(src)),
                                              as_h2(0x64086408u)));  // - 1032
        return as_u32(__hfma2(as_h2(magic_pair<0x00F000F0>(src)), as_h2(0x2C002C00u),
                              as_h2(0xD480D480u)));  // / 16 - 72
      }
      return (word >> (4 * s)) & kMask;
    };
#pragma unroll
    for (int s = 0; s < kFrags; ++s) {
      const uint32_t a0 = operand(v.x, s), a1 = operand(v.y, s);
      const uint32_t a2 = operand(v.z, s), a3 = operand(v.w, s);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        const uint4& xt = t % 2 == 0 ? xa : xb;
        const uint32_t b0 = kX ? (s % 2 == 0 ? xt.x : xt.z) : b[t][0];
        const uint32_t b1 = kX ? (s % 2 == 0 ? xt.y : xt.w) : b[t][1];
        if constexpr (kMode == 1) {
          hmma(f[s][t], a0, a1, a2, a3, b0, b1);
        } else if constexpr (kMode == 2) {
          imma(i[s][t], a0, a1, a2, a3, b0, b1);
        }
      }
    }
  }
  // The GEMV's end of block with one group per block: the block's sums, scaled, join the
  // totals, and the block's accumulators start again from zero.
  __device__ void scale_block(float scale) {
#pragma unroll
    for (int s = 0; s < kFrags; ++s)
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float block = kMode == 2 ? static_cast<float>(i[s][t][e]) : f[s][t][e];
          total[s][t][e] = fmaf(block, scale, total[s][t][e]);
          f[s][t][e] = 0.0f;
          i[s][t][e] = 0;
        }
  }
  __device__ float sum() const {
    float r = 0.0f;
#pragma unroll
    for (int s = 0; s < kFrags; ++s)
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          r += f[s][t][e] + static_cast<float>(i[s][t][e]) + total[s][t][e];
        }
    return r;
  }
};

// Grid-stride over nq qweight then ns scales 16-byte groups, kUnroll groups per round;
// products on the qweight ones. The weights come straight to registers (two rounds held), or
// with kRing through a per-thread shared-memory ring of kStages rounds (cp.async, each thread
// reads back what it copied, as the GEMV's lanes do). kX adds the GEMV's activation traffic at
// 16 tokens: per group, 16 bytes of x (L2-resident, nx a power of two) copied into a ring like
// the weights', and 32 bytes read back (the thread's own and its neighbour lane's), which are
// then the B operands. kDq (with both) adds the GEMV's arithmetic: bit 0, A as the exact q - 8
// (the GEMV's LOP3 and HSUB2 / HFMA2 per register; imma keeps the raw nibbles); bit 1, per round
// of kUnroll groups (the GEMV's 128-row block per lane), the block's sums scaled into totals;
// bit 2, a named barrier per round for each pair of warps (the GEMV's pairs at 16 tokens); bit 3,
// the first two rounds' x copies only after griddepcontrol.wait, as the GEMV must (its x is the
// previous kernel's output).
template <int kMode, int kTiles, bool kRing, bool kX, int kDq = 0>
__global__ void __launch_bounds__(kThreads) floor_kernel(
    const uint4* __restrict__ qw, long long nq, const uint4* __restrict__ sc, long long ns,
    const uint32_t* __restrict__ bsrc, const uint4* __restrict__ x, long long nx,
    unsigned* __restrict__ out) {
  extern __shared__ uint4 smem[];
  uint4* ring = smem;                             // kRing: weights
  const int ring_words = kStages * kUnroll * blockDim.x;  // uint4 per shared-memory ring
  uint4* xring = smem + (kRing ? ring_words : 0);  // kX: activations
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long n = nq + ns, stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const long long first = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long round = kUnroll * stride;
  auto src = [&](long long j) { return j < nq ? qw + j : j < n ? sc + (j - nq) : qw; };
  auto fetch = [&](long long j) { return j < n ? __ldcs(src(j)) : make_uint4(0, 0, 0, 0); };
  auto slot = [](int stage, int u) { return (stage * kUnroll + u) * blockDim.x + threadIdx.x; };
  // one round's copies (weights w, activations a); a cp.async group per round, maybe empty
  auto copy = [&](long long base, int stage, bool w, bool a) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long j = base + u * stride;
      if (kRing && w) cp_async16(ring + slot(stage, u), src(j), j < n ? 16 : 0);
      if (kX && a) cp_async16(xring + slot(stage, u), x + (j & (nx - 1)), j < n ? 16 : 0);
    }
  };
  auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
  auto issue = [&](long long base, int stage) {
    copy(base, stage, true, true);
    commit();
  };
  constexpr bool kLateX = (kDq & 8) != 0;
  uint4 cur[kUnroll], nxt[kUnroll];
  if constexpr (!kRing) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) cur[u] = fetch(first + u * stride);
  }
  if constexpr (kLateX) {  // the GEMV's order: both rounds' weights, the wait, then x by rounds
    copy(first, 0, true, false);
    copy(first + round, 1, true, false);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    copy(first, 0, false, true);
    commit();
    copy(first + round, 1, false, true);
    commit();
  } else {
    issue(first, 0);
    issue(first + round, 1);
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  Products<kMode, kTiles> prod;
  if constexpr (kMode != 0 && !kX) prod.load_b(bsrc);
  unsigned acc = 0;
  int stage = 0;
  const float scale = 1.0f + 1e-3f * static_cast<float>(threadIdx.x % 8);  // kDq
  // CTA-uniform trip count: every thread of a warp (and of a pair, for kDq bit 2) runs the same
  // rounds; past n, the loads are zero-filled and only XOR-ed
  for (long long i = first, base = first - threadIdx.x; base < n; i += round, base += round) {
    __syncwarp();  // the neighbour lane has read the slots the next copy overwrites
    issue(i + 2 * round, (stage + 2) % kStages);
    if constexpr (!kRing) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) nxt[u] = fetch(i + round + u * stride);
    }
    asm volatile("cp.async.wait_group 2;" ::: "memory");
    if constexpr ((kDq & 4) != 0) {  // the GEMV's named barrier of a warp pair, once per block
      asm volatile("bar.sync %0, 64;" ::"r"(1 + static_cast<int>(threadIdx.x) / 64) : "memory");
    } else {
      __syncwarp();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint4 w = kRing ? ring[slot(stage, u)] : cur[u];
      if (kMode != 0 && i + u * stride < nq) {
        if constexpr (kX) {
          const int at = slot(stage, u);
          prod.template add<true, (kDq & 1) != 0>(w, xring[at], xring[at ^ 1]);
        } else {
          prod.template add<false, (kDq & 1) != 0>(w, w, w);
        }
      } else {
        acc ^= w.x ^ w.y ^ w.z ^ w.w;
      }
      if constexpr (!kRing) cur[u] = nxt[u];
    }
    if constexpr ((kDq & 2) != 0 && kMode != 0) prod.scale_block(scale);  // a round: a block
    stage = (stage + 1) % kStages;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  if (acc == 0x12345678u || prod.sum() == 1.2345f) out[blockIdx.x] = acc;  // keeps the work
}

using Kernel = void (*)(const uint4*, long long, const uint4*, long long, const uint32_t*,
                        const uint4*, long long, unsigned*);

template <int kMode, int kTiles>
Kernel pick(bool ring, bool xpath, int dq) {
  switch (dq) {  // with ring and x only
    case 1: return floor_kernel<kMode, kTiles, true, true, 1>;
    case 2: return floor_kernel<kMode, kTiles, true, true, 2>;
    case 3: return floor_kernel<kMode, kTiles, true, true, 3>;
    case 4: return floor_kernel<kMode, kTiles, true, true, 4>;
    case 11: return floor_kernel<kMode, kTiles, true, true, 11>;
    default: break;
  }
  if (ring) {
    return xpath ? floor_kernel<kMode, kTiles, true, true>
                 : floor_kernel<kMode, kTiles, true, false>;
  }
  return xpath ? floor_kernel<kMode, kTiles, false, true>
               : floor_kernel<kMode, kTiles, false, false>;
}

void launch(torch::Tensor qw, torch::Tensor sc, torch::Tensor bsrc, torch::Tensor x,
            torch::Tensor out, int64_t ctas, int64_t threads, int64_t mode, int64_t tiles,
            bool ring, bool xpath, int64_t dq) {
  TORCH_CHECK(0 <= mode && mode < 3 && 1 <= tiles && tiles <= 2, "bad mode / tiles");
  TORCH_CHECK((0 <= dq && dq <= 4) || dq == 11, "dq: 0..4 or 11");
  TORCH_CHECK(dq == 0 || (ring && xpath), "dq needs ring and x");
  using Picker = Kernel (*)(bool, bool, int);
  constexpr Picker kPick[3][2] = {
      {pick<0, 1>, pick<0, 1>}, {pick<1, 1>, pick<1, 2>}, {pick<2, 2>, pick<2, 4>}};
  const Kernel kernel = kPick[mode][tiles - 1](ring, xpath, static_cast<int>(dq));
  TORCH_CHECK(threads % 64 == 0 && 64 <= threads && threads <= kThreads, "threads: 64..256, by 64");
  const int smem = (int(ring) + int(xpath)) * kStages * kUnroll * static_cast<int>(threads) * 16;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const auto* q = reinterpret_cast<const uint4*>(qw.data_ptr());
  const auto* s = reinterpret_cast<const uint4*>(sc.data_ptr());
  const auto* b = reinterpret_cast<const uint32_t*>(bsrc.data_ptr<int32_t>());
  const auto* xp = reinterpret_cast<const uint4*>(x.data_ptr());
  auto* o = reinterpret_cast<unsigned*>(out.data_ptr<int32_t>());
  const long long nq = qw.numel() * qw.element_size() / 16;
  const long long ns = sc.numel() * sc.element_size() / 16;
  const long long nx = x.numel() * x.element_size() / 16;
  TORCH_CHECK(nx > 0 && (nx & (nx - 1)) == 0, "x must hold a power of two of 16-byte groups");
  pagedq::gptq_host::launch(kernel, static_cast<int>(ctas), static_cast<int>(threads), smem,
                            /*pdl=*/true, q, nq, s, ns, b, xp, nx, o);
}
"""

CPP = """
#include <torch/extension.h>
void launch(torch::Tensor qw, torch::Tensor sc, torch::Tensor bsrc, torch::Tensor x,
            torch::Tensor out, int64_t ctas, int64_t threads, int64_t mode, int64_t tiles,
            bool ring, bool xpath, int64_t dq);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("launch", &launch); }
"""

MODES = {"stream": 0, "hmma": 1, "imma": 2}


@dataclass(frozen=True)
class Row:
    """One probe: `mode` (MODES) at `m` tokens (a multiple of 8, at most 16), `per_sm` CTAs of
    `threads` threads per SM; `path` (PATHS) adds the GEMV's shared-memory traffic."""

    mode: str
    m: int
    per_sm: int
    path: str = "none"
    threads: int = 256

    @property
    def tiles(self) -> int:
        """Tiles of 8 tokens: the kernels' token-tile template index (imma doubles it inside)."""
        return 1 if self.mode == "stream" else self.m // 8

    @property
    def ring(self) -> bool:
        return "ring" in self.path

    @property
    def xpath(self) -> bool:
        return "x" in self.path.split("+")

    @property
    def dq(self) -> int:
        """What of the GEMV the row adds (floor_kernel's kDq): bit 0 the q - 8 subtraction, bit 1
        the scale per block, bit 2 the warp pairs' barrier per block, bit 3 x after the wait."""
        bits = {"dq": 3, "sub": 1, "scale": 2, "bar": 4, "xwait": 8}
        out = 0
        for part in self.path.split("+"):  # ring, x and none add no bit
            out |= bits.get(part, 0)
        return out

    @property
    def name(self) -> str:
        base = "stream" if self.mode == "stream" else f"{self.mode}, M={self.m}"
        return base if self.path == "none" else f"{base}, {PATHS[self.path]}"


# What a row adds to the loads and products, and how the table names it.
PATHS = {
    "none": "",
    "ring": "weights via a shared-memory ring",
    "x": "x via shared memory",
    "ring+x": "weights and x via shared memory",
    "ring+x+dq": "weights and x via shared memory, q - 8 and a scale per block",
    "ring+x+sub": "weights and x via shared memory, q - 8",
    "ring+x+scale": "weights and x via shared memory, a scale per block",
    "ring+x+bar": "weights and x via shared memory, a barrier per warp pair and block",
    "ring+x+dq+xwait": "weights and x via shared memory, q - 8 and a scale per block, x after "
    "the wait",
}


def rows_for(
    ms: list[int], per_sm: list[int], paths: list[str], threads: tuple[int, ...] = (256,)
) -> list[Row]:
    """The stream row, then hmma and imma at each M and path, each at every CTA count and size."""
    bad = [m for m in ms if m not in (8, 16)]
    if bad:
        raise ValueError(f"--ms takes 8 and 16 only (tiles of 8 tokens), got {bad}")
    if not all(1 <= c <= 8 for c in per_sm):
        raise ValueError(f"--ctas-per-sm takes 1..8 (the output words per SM), got {per_sm}")
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"--paths takes {', '.join(PATHS)}, got {unknown}")
    probes = [(md, m, p) for m in ms for md in ("hmma", "imma") for p in paths]
    if not all(t in (64, 128, 192, 256) for t in threads):
        raise ValueError(f"--threads takes 64, 128, 192 and 256 (pairs of warps), got {threads}")
    return [
        Row(mode, m, c, p, t)
        for mode, m, p in [("stream", 0, "none"), *probes]
        for t in threads
        for c in per_sm
    ]


def b_operands(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """B words per lane and tile, [32 lanes * 4 tiles * 2] int32: N(0, 1) fp16 pairs for hmma,
    uniform s8 quads for imma (the byte slices of 16-bit activations)."""
    fp16 = torch.randn(32 * 4 * 2 * 2, generator=gen).half().view(torch.int32)
    s8 = torch.randint(-128, 128, (32 * 4 * 2 * 4,), generator=gen, dtype=torch.int8)
    return {"hmma": fp16, "imma": s8.view(torch.int32), "stream": fp16}


def build():  # type: ignore[no-untyped-def]
    return load_probe("pagedq_w4a_floor", CPP, SOURCE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="16", help="token counts (8, 16), comma-separated")
    ap.add_argument("--ctas-per-sm", default="1,2", help="CTAs per SM to try")
    ap.add_argument("--threads", default="256", help="threads per CTA to try (64..256, by 64)")
    ap.add_argument(
        "--paths", default="none", help=f"shared-memory paths per probe ({', '.join(PATHS)})"
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--clocks", type=float, default=2.0, help="seconds of nvidia-smi sampling")
    ap.add_argument("--log", type=Path)
    args = ap.parse_args(argv)
    rows = rows_for(
        [int(v) for v in args.ms.split(",")],
        [int(v) for v in args.ctas_per_sm.split(",")],
        args.paths.split(","),
        tuple(int(v) for v in args.threads.split(",")),
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
    # 512 KB: stays in L2, as the GEMV's x does; a power of two of 16-byte groups, so that a
    # group's address is a mask of its index (a 64-bit modulo per copy ran 0.5 ms slower)
    x = torch.randn(16, 16384, device="cuda").half()
    idle = smi_query("power.draw")
    lines = [
        f"# {props.name}, torch {torch.__version__}; bench/w4a_floor.py " + " ".join(sys.argv[1:]),
        f"stack bytes {nbytes / 1e9:.3f} GB; idle board power "
        f"{idle[0] if idle else float('nan'):.0f} W",
        "| probe | CTAs/SM x threads | stack ms | TB/s | SM MHz | board W | J per stack | "
        + " / ".join(name for name, _, _ in SHAPES)
        + " µs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def measure(name: str, per_sm: str, make: Callable[[list[PackedGPTQWeight]], Stack]) -> None:
        """One row: the stack, then µs per launch of each layer shape (its 32 launches alone in
        one graph), which tells time that scales with bytes from time per launch."""
        replay = graphed(make(weights))
        ms = min(time_ms(replay, args.repeats) for _ in range(3))
        smi = smi_query("clocks.sm,power.draw", args.clocks, replay) if args.clocks else None
        mhz, watts = (smi[0], smi[1]) if smi else (float("nan"), float("nan"))
        layer = [
            time_ms(graphed(make(weights[i :: len(SHAPES)])), args.repeats) * 1000 / LAYERS
            for i in range(len(SHAPES))
        ]
        lines.append(
            f"| {name} | {per_sm} | {ms:.3f} | {nbytes / ms / 1e9:.2f} | {mhz:.0f} | "
            f"{watts:.0f} | {watts * ms / 1e3:.3f} | "
            + " / ".join(f"{v:.1f}" for v in layer)
            + " |"
        )
        print(lines[-1], flush=True)

    for row in rows:
        ctas = props.multi_processor_count * row.per_sm

        def make(ws: list[PackedGPTQWeight], row: Row = row, ctas: int = ctas) -> Stack:
            mode, b = MODES[row.mode], bsrc[row.mode]

            def stack() -> None:
                for w in ws:
                    ext.launch(w.qweight, w.scales, b, x, out, ctas, row.threads, mode, row.tiles,
                               row.ring, row.xpath, row.dq)  # fmt: skip

            return stack

        measure(row.name, f"{row.per_sm} x {row.threads}", make)
    for m in sorted({r.m for r in rows if r.m}):

        def pagedq(ws: list[PackedGPTQWeight], m: int = m) -> Stack:
            return pagedq_stack(ws, m)

        measure(f"pagedq ops.gptq_matmul, M={m}", "-", pagedq)
    text = "\n".join(lines)
    print(text)
    if args.log:
        args.log.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
