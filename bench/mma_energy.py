"""Energy per multiply-accumulate of the H200's tensor-core instructions, on operands shaped like
the W4a GEMV's: the weights as small integers (q - 8), the activations as N(0, 1) fp16.

The M=16 W4a stack runs at the board's 700 W limit, so its time follows its energy
(bench/results/gptq_w4a_2026-12-01k_notes.md), and its tensor-core work grows with the tokens.
This script asks whether another instruction would do the same products for less energy:
- hmma: mma.sync m16n8k16, f16 inputs, f32 accumulators (the GEMV's); also with B all zeros
  (every product zero), with the roles swapped (A random, B the small integers), with f16
  accumulators, in the orders a GEMV step of 2 weight tiles by 2 token tiles can take (which
  operand consecutive instructions repeat), with one operand tile shared by every warp (the
  datapath then sees one value, however the schedulers interleave warps), with other fp16
  forms of the weights, and with the activations rounded to fewer significant bits;
- hmma on bf16 inputs (the same shapes; bf16 activations carry 8 significant bits, not 11);
- imma: mma.sync m16n8k32, s8 inputs, s32 accumulators (the one-token GEMV's);
- wgmma: wgmma m64n16k16 (sm_90a), f16 A from registers (the dequantized weights would be
  there), 16 tokens of f16 B from shared memory, f32 accumulators.

Each kernel cycles through 8 register sets of random operands (and 8 shared-memory B tiles), so
that consecutive instructions switch their inputs' bits as a GEMV's do, and loads nothing else.
Per kernel, while it runs back to back: MACs per second from CUDA events, and the SM clock and
board power sampled by nvidia-smi (medians past the first quarter of the samples). pJ per MAC is
the board power over the MAC rate; "above idle" subtracts the idle board's power. Prints one
table; --log writes it too.

    PYTHONPATH=. python3 bench/mma_energy.py --seconds 3 --log $OUT/mma_energy.log
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gptq_stacks import smi_query
from cuda_ext.build import load_probe

SOURCE = r"""
#include <cuda_fp16.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>
#include <cstdint>

constexpr int kSets = 8;  // operand sets a thread cycles through

__device__ inline void hmma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ inline void imma(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ inline void hmma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ inline void hmma16(uint32_t (&d)[2], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, "
      "{%0,%1};"
      : "+r"(d[0]), "+r"(d[1])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ops: [threads][kSets][6] words (A's 4, then B's 2); each thread adds its sums to out[tid].
// kMode: 0 hmma (f32 accumulators), 1 imma, 2 hmma with f16 accumulators, 3 hmma on bf16.
// kOrder picks the operand sets of instruction s of a group of kSets: 0, A set s and B set s;
// otherwise two A and two B sets per 4 instructions, each pair of them once, as in a GEMV's step
// of 2 weight tiles by 2 token tiles, in the order that repeats A (1), B (2), or one then the
// other (3) in consecutive instructions; 4 keeps one B set, 5 one A set throughout.
__host__ __device__ constexpr int pick_a(int order, int s) {
  const int base = 2 * (s / 4), i = s % 4;
  switch (order) {
    case 1: return base + i / 2;               // A0B0 A0B1 A1B0 A1B1 (the GEMV's SASS)
    case 2: return base + i % 2;               // A0B0 A1B0 A0B1 A1B1
    case 3: return base + (i == 1 || i == 2);  // A0B0 A1B0 A1B1 A0B1
    case 5: return 0;
    default: return s;
  }
}
__host__ __device__ constexpr int pick_b(int order, int s) {
  const int base = 2 * (s / 4), i = s % 4;
  switch (order) {
    case 1: return base + i % 2;
    case 2:
    case 3: return base + i / 2;
    case 4: return 0;
    default: return s;
  }
}

template <int kMode, int kOrder = 0>
__global__ void mma_loop(const uint32_t* __restrict__ ops, float* __restrict__ out, int iters) {
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t a[kSets][4], b[kSets][2];
#pragma unroll
  for (int s = 0; s < kSets; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = ops[(tid * kSets + s) * 6 + i];
    b[s][0] = ops[(tid * kSets + s) * 6 + 4];
    b[s][1] = ops[(tid * kSets + s) * 6 + 5];
  }
  float acc[4][4] = {};
  int iacc[4][4] = {};
  uint32_t hacc[4][2] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int s = 0; s < kSets; ++s) {
      const int sa = pick_a(kOrder, s), sb = pick_b(kOrder, s);
      if constexpr (kMode == 1) {
        imma(iacc[s % 4], a[sa], b[sb]);
      } else if constexpr (kMode == 2) {
        hmma16(hacc[s % 4], a[sa], b[sb]);
      } else if constexpr (kMode == 3) {
        hmma_bf16(acc[s % 4], a[sa], b[sb]);
      } else {
        hmma(acc[s % 4], a[sa], b[sb]);
      }
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sum += acc[j][i] + static_cast<float>(iacc[j][i]);
    sum += __half2float(__ushort_as_half(static_cast<uint16_t>(hacc[j][0] ^ hacc[j][1])));
  }
  out[tid] += sum;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAVE_WGMMA 1
#endif

// A no-swizzle K-major descriptor: 8-row x 16-byte core matrices, 128 bytes apart along K and
// 256 along N (the values are random, so only the byte count per instruction matters).
__device__ inline uint64_t desc_at(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}

__device__ inline void wgmma16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
#ifdef HAVE_WGMMA
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, 1, 0; "
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, %12, p, 1, 1, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

// ops as in mma_loop (A's 4 words per set); btiles: kSets tiles of 16 x 16 f16 for B, shared by
// the CTA. One warpgroup per CTA; a group of kSets wgmmas per iteration, two groups in flight.
__global__ void __launch_bounds__(128) wgmma_loop(const uint32_t* __restrict__ ops,
                                                  const uint32_t* __restrict__ btiles,
                                                  float* __restrict__ out, int iters) {
#ifdef HAVE_WGMMA
  __shared__ __align__(128) uint32_t tiles[kSets * 128];
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (int i = threadIdx.x; i < kSets * 128; i += blockDim.x) tiles[i] = btiles[i];
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  uint32_t a[kSets][4];
#pragma unroll
  for (int s = 0; s < kSets; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = ops[(tid * kSets + s) * 6 + i];
  }
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tiles));
  float acc[4][8] = {};
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < kSets; ++s) wgmma16(acc[s % 4], a[s], desc_at(base + 512 * s));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += acc[j][i];
  }
  out[tid] += sum;
#endif
}

void run_mma(torch::Tensor ops, torch::Tensor out, int64_t iters, int64_t mode,
             int64_t order) {
  const int threads = 128, blocks = static_cast<int>(out.numel()) / threads;
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* o = reinterpret_cast<const uint32_t*>(ops.data_ptr<int32_t>());
  using Loop = void (*)(const uint32_t*, float*, int);
  constexpr Loop kOrders[] = {mma_loop<0, 0>, mma_loop<0, 1>, mma_loop<0, 2>,
                              mma_loop<0, 3>, mma_loop<0, 4>, mma_loop<0, 5>};
  const Loop loop = mode == 1   ? mma_loop<1>
                    : mode == 2 ? mma_loop<2>
                    : mode == 3 ? mma_loop<3>
                                : kOrders[order];
  loop<<<blocks, threads, 0, stream>>>(o, out.data_ptr<float>(), iters);
}

void run_wgmma(torch::Tensor ops, torch::Tensor btiles, torch::Tensor out, int64_t iters) {
  const int threads = 128, blocks = static_cast<int>(out.numel()) / threads;
  auto stream = at::cuda::getCurrentCUDAStream();
  wgmma_loop<<<blocks, threads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(ops.data_ptr<int32_t>()),
      reinterpret_cast<const uint32_t*>(btiles.data_ptr<int32_t>()), out.data_ptr<float>(), iters);
}
"""

CPP = """
#include <torch/extension.h>
void run_mma(torch::Tensor ops, torch::Tensor out, int64_t iters, int64_t mode, int64_t order);
void run_wgmma(torch::Tensor ops, torch::Tensor btiles, torch::Tensor out, int64_t iters);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run_mma", &run_mma);
  m.def("run_wgmma", &run_wgmma);
}
"""

SETS = 8
ITERS = 20000  # loop iterations per launch: a few ms


@dataclass(frozen=True)
class Kind:
    """One row: the instruction (`mode` of mma_loop, -1: wgmma_loop) and its operands."""

    name: str
    mode: int
    macs: int  # per instruction
    warps: int  # that issue one instruction together
    int8: bool = False
    order: int = 0  # hmma only: kOrder of mma_loop, the order of the operand sets
    zero_b: bool = False  # B all zeros: every product is zero, the datapath's floor
    x_as_a: bool = False  # the roles swapped: A is N(0, 1), B the small integers
    a_form: str = "q - 8"  # fp16 A (A_FORMS): how the weights' nibble q reaches the mma
    # the same tile in every warp and set (lane i of each warp holds the same words), so the
    # datapath sees one operand value whichever warps it interleaves
    same_a: bool = False
    same_b: bool = False
    b_bits: int = 11  # fp16 B rounded to this many significant bits (11: as drawn)


KINDS = (
    Kind("hmma", 0, 16 * 8 * 16, 1),
    Kind("hmma, B = 0", 0, 16 * 8 * 16, 1, zero_b=True),
    Kind("hmma, x as A", 0, 16 * 8 * 16, 1, x_as_a=True),
    Kind("hmma, f16 accumulators", 2, 16 * 8 * 16, 1),
    Kind("hmma, 2x2 tiles, A repeated (the GEMV's order)", 0, 16 * 8 * 16, 1, order=1),
    Kind("hmma, 2x2 tiles, B repeated", 0, 16 * 8 * 16, 1, order=2),
    Kind("hmma, 2x2 tiles, A and B repeated in turn", 0, 16 * 8 * 16, 1, order=3),
    Kind("hmma, one B throughout", 0, 16 * 8 * 16, 1, order=4),
    Kind("hmma, one A throughout", 0, 16 * 8 * 16, 1, order=5),
    Kind("hmma, one B tile in every warp", 0, 16 * 8 * 16, 1, same_b=True),
    Kind("hmma, one A tile in every warp", 0, 16 * 8 * 16, 1, same_a=True),
    Kind("hmma, one A and one B tile in every warp", 0, 16 * 8 * 16, 1, same_a=True, same_b=True),
    Kind("hmma, A = q (0..15)", 0, 16 * 8 * 16, 1, a_form="q"),
    Kind("hmma, A = 1024 + q", 0, 16 * 8 * 16, 1, a_form="1024 + q"),
    Kind("hmma, A = q * 2^-24 (subnormal)", 0, 16 * 8 * 16, 1, a_form="q * 2^-24"),
    Kind("hmma, B to 8 significant bits (bf16's)", 0, 16 * 8 * 16, 1, b_bits=8),
    Kind("hmma, B to 4 significant bits", 0, 16 * 8 * 16, 1, b_bits=4),
    Kind("hmma bf16", 3, 16 * 8 * 16, 1),
    Kind("imma", 1, 16 * 8 * 32, 1, int8=True),
    Kind("wgmma m64n16k16", -1, 64 * 16 * 16, 4),
)


def build():  # type: ignore[no-untyped-def]
    return load_probe("pagedq_mma_energy", CPP, SOURCE)


# fp16 A values from nibbles q in 0..15: the GEMV's q - z' (z' = 8), the nibble itself, the
# magic-number form before its subtraction, and the subnormal whose bits are q.
A_FORMS = {
    "q - 8": lambda q: (q - 8).to(torch.float16),
    "q": lambda q: q.to(torch.float16),
    "1024 + q": lambda q: (q + 1024).to(torch.float16),
    "q * 2^-24": lambda q: q.to(torch.int16).view(torch.float16),
}


def round_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits` significant bits (to nearest; 11 or more: unchanged for fp16)."""
    if bits >= 11:
        return x
    mant, exp = torch.frexp(x)
    return torch.ldexp(torch.round(torch.ldexp(mant, torch.full_like(exp, bits))), exp - bits)


def operands(threads: int, kind: Kind, gen: torch.Generator) -> torch.Tensor:
    """[threads, SETS, 6] words: A as kind.a_form of q (uniform in 0..15), B as N(0, 1); fp16
    pairs, or s8 quads with B uniform bytes."""
    shape = (threads, SETS, 6)
    if kind.int8:
        a = torch.randint(-8, 8, (*shape[:2], 4, 4), generator=gen, dtype=torch.int8)
        b = torch.randint(-128, 128, (*shape[:2], 2, 4), generator=gen, dtype=torch.int8)
    else:

        def small(words: int) -> torch.Tensor:
            q = torch.randint(0, 16, (*shape[:2], words, 2), generator=gen)
            if kind.mode == 3:
                return (q - 8).to(torch.bfloat16)
            return A_FORMS[kind.a_form](q)

        def normal(words: int) -> torch.Tensor:
            x = torch.randn((*shape[:2], words, 2), generator=gen)
            if kind.mode == 3:
                return x.to(torch.bfloat16)
            return round_bits(x, kind.b_bits).to(torch.float16)

        a, b = (normal(4), small(2)) if kind.x_as_a else (small(4), normal(2))
    if kind.zero_b:
        b.zero_()
    lanes = torch.arange(threads) % 32
    if kind.same_a:
        a = a[lanes, :1].expand_as(a).contiguous()
    if kind.same_b:
        b = b[lanes, :1].expand_as(b).contiguous()
    return torch.cat([a.view(torch.int32), b.view(torch.int32)], dim=2).reshape(shape)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="power sampling per kernel")
    ap.add_argument("--ctas-per-sm", type=int, default=4)
    ap.add_argument("--log", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    ext = build()
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator().manual_seed(0)
    blocks = props.multi_processor_count * args.ctas_per_sm
    threads = blocks * 128
    out = torch.zeros(threads, device="cuda")
    btiles = torch.randn(SETS * 256, generator=gen).to(torch.float16).view(torch.int32).cuda()
    time.sleep(2.0)
    idle = smi_query("clocks.sm,power.draw")
    idle_w = idle[1] if idle else float("nan")
    lines = [
        f"# {props.name}, torch {torch.__version__}; bench/mma_energy.py " + " ".join(sys.argv[1:]),
        f"idle board power: {idle_w:.0f} W; {blocks} CTAs of 128 threads, {SETS} operand sets each",
        "| instruction | TMAC/s | SM MHz | board W | pJ/MAC | pJ/MAC above idle |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind in KINDS:
        if kind.mode < 0 and torch.cuda.get_device_capability() != (9, 0):
            continue  # wgmma is sm_90a only
        ops = operands(threads, kind, gen).cuda()
        launches = 0

        def launch(ops: torch.Tensor = ops, kind: Kind = kind) -> None:
            nonlocal launches
            launches += 1
            if kind.mode < 0:
                ext.run_wgmma(ops, btiles, out, ITERS)
            else:
                ext.run_mma(ops, out, ITERS, kind.mode, kind.order)

        launch()  # warm-up
        torch.cuda.synchronize()
        launches = 0
        # the MAC rate over the same launches as the power samples
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        smi = smi_query("clocks.sm,power.draw", args.seconds, launch)
        end.record()
        end.synchronize()
        macs = threads // 32 / kind.warps * ITERS * SETS * kind.macs * launches
        rate = macs / (start.elapsed_time(end) / 1e3)
        mhz, watts = (smi[0], smi[1]) if smi else (float("nan"), float("nan"))
        lines.append(
            f"| {kind.name} | {rate / 1e12:.0f} | {mhz:.0f} | {watts:.0f} | "
            f"{watts / rate * 1e12:.3f} | {(watts - idle_w) / rate * 1e12:.3f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.log:
        args.log.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
