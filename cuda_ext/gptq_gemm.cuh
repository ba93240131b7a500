// GPTQ 4-bit matmul for larger batches on Hopper (sm_90a): wgmma with the dequantized weights as
// the register operand, activations from shared memory, fp32 accumulation, stream-K.
//
// out^T [N, M] = W^T [N, K] x^T [K, M]. A CTA tile is BT tokens (the wgmma N) x 256 output
// columns for BT = 64 or 128, or x 128 columns for BT = 256: two warpgroups of two m64 wgmma tiles
// each, or of one, so a thread holds at most 128 accumulators. Every weight is dequantized once
// per BT tokens, and every activation is read from L2 once per tile width (the Triton GEMM's
// 64-column tiles read x four times as often). 256-token tiles halve the dequantization per
// token (H200 stacks of the bench's layers against 128-token tiles: M=256 6.75 vs 7.31 ms,
// M=2048 46.6 vs 50.9).
//
// Layout: the packed weights of pagedq/ops/gptq.py, as in gptq_gemv.cuh (block b = word rows
// 16b..16b+15 = input rows 128b..128b+127; nibble p + 4h of word row r is input row 32p + 2r + h).
// The k16 slice (p, s) of a block is input rows 32p + 16s + 0..15, in natural order, so x needs
// no permutation: A's k pair (2t, 2t + 1) of that slice is nibble pair p of word row 8s + t, and
// (2t + 8, 2t + 9) that of word row 8s + t + 4. A's row g of warp w is output column 16w + 2g and
// row g + 8 is column 16w + 2g + 1, so a lane's two columns are one 8-byte shared-memory read per
// word row and one 4-byte store per token.
//
// Pipeline, warp-specialized. A stage holds one 128-row block: x [BT tokens x 128] as two
// 128-byte-swizzled halves (the wgmma B operand, K-major; two TMA tensor copies, zeros past M and
// K), the 16 word rows of the tile's columns and their scales (and zeros). A producer warpgroup
// (one thread issues; 40 registers) fills the stages with bulk copies counted in bytes by each
// stage's `full` mbarrier; the two consumer warpgroups (232 registers) wait on it, compute, and
// release the stage through its `empty` mbarrier once the wgmmas that read it are done. No CTA
// barrier in the loop, so the warpgroups drift apart and one's wgmmas cover the other's
// dequantization (H200, M=256 gate_up: 84 µs; 102 with every thread copying and a barrier per
// block). Each block is two halves of four k16 slices whose A fragments live in two register
// sets, so one half's wgmmas run while the next half is dequantized (wgmma.wait_group 1).
//
// Work split, as in gptq_gemv.cuh (Split, with runs of one block): items are (tile, block) in
// tile-major order, tiles (column tile, token tile) with the token tiles of a column tile
// adjacent; the persistent grid gives CTA c the items [c * items / C, (c + 1) * items / C). A
// split tile is finished by the CTA owning its first block (that segment is the CTA's last): the
// other contributors store their accumulators to workspace slot `cta` (one per CTA, fragment
// order, all kEmpty between launches) and the owner adds them in CTA order as they land. Where
// the tiles fit on the GPU, the grid is instead k CTAs per tile (`gemm_grid`: an exact split,
// same item ranges), and each of a tile's k CTAs reduces and writes a k-th of it (`gemm_share`).
#pragma once

#include <cuda.h>  // CUtensorMap (a kernel parameter type; no driver calls here)

#include <algorithm>
#include <type_traits>

#include "gptq_gemv.cuh"

namespace pagedq {
namespace gptq {

constexpr int kGemmThreads = 256;           // the two consumer warpgroups
constexpr int kProducerThreads = 128;       // the producer warpgroup (one thread copies)
constexpr int kGemmBlock = kProducerThreads + kGemmThreads;

// The tile of BT tokens: two consumer warpgroups of kMT m64 wgmma tiles each (kCols columns).
template <int BT>
struct GemmTile {
  static constexpr int kMT = BT > 128 ? 1 : 2;   // m64 tiles per warpgroup
  static constexpr int kCols = 128 * kMT;        // output columns per tile
  static constexpr int kWordStride = kCols + 8;  // words per smem word row: reads spread banks
  static constexpr int kPieces = kMT * BT / 8;   // 16-byte pieces of a thread's accumulators
};

// Pipeline stages: as many as fit in shared memory (a 256-token stage is 74-75 KB, 128: 50-53 KB,
// 64: 34-37 KB).
template <int BT>
__host__ __device__ constexpr int gemm_stages() {
  return BT > 128 ? 3 : BT > 64 ? 4 : 6;
}

struct GemmParams {
  const void* x;           // [M, K] T, row stride x_stride elements
  const int32_t* qweight;  // [Kp/8, N]
  const void* scales;      // [G, N] T
  const void* zeros;       // [G, N] T (z') or nullptr: every z' is 8
  const void* bias;        // [N] T or nullptr
  void* out;               // [M, N] T contiguous
  float* workspace;        // [>= ctas * 1024 * kPieces] fp32, all kEmpty between launches
  int64_t x_stride;
  int M, N, K;             // K % 8 == 0, N % 8 == 0
  int group_size, num_groups;
  int tiles_m, tiles_n, num_blocks;  // ceil(M / BT), ceil(N / kCols), ceil(K / 128)
  int split;  // k > 0: ctas = k * tiles, tile t in k equal parts (CTAs kt..kt+k-1); 0: stream-K
};

// The grid for `tiles` tiles of `num_blocks` blocks on `resident` resident CTAs; sets `split`.
// When the tiles fit, each is split into k = resident / tiles equal parts, as long as that keeps
// 90% of the CTAs busy: no CTA then straddles two tiles, all parts end together, and the k CTAs
// of a tile reduce it a share each. Otherwise stream-K over every resident CTA. H200 per layer,
// exact split against stream-K: down at M=256 (k = 4) 51.4 µs vs 57.0, o at M=64 (k = 8) 14.4
// vs 21.1; but qkv at M=256 in 96 whole tiles (73% of the CTAs) 57.1 vs 53.4.
inline int gemm_grid(int64_t tiles, int num_blocks, int resident, int& split) {
  const int64_t k = std::min<int64_t>(resident / tiles, num_blocks);
  if (k >= 1 && 10 * k * tiles >= 9 * int64_t{resident}) {
    split = static_cast<int>(k);
    return static_cast<int>(k * tiles);
  }
  split = 0;
  return static_cast<int>(std::min<int64_t>(resident, tiles * num_blocks));
}

// Byte offsets of one pipeline stage in shared memory (1024-aligned: the swizzle atom).
template <int BT, bool PQ>
struct GemmStage {
  static constexpr int kQ = PQ ? 4 : 1;                 // scale rows per block
  static constexpr int kXHalf = BT * 128;               // BT tokens x 64 k x 2 bytes
  static constexpr int kW = 2 * kXHalf;                 // word rows
  static constexpr int kCols = GemmTile<BT>::kCols;
  static constexpr int kS = kW + 16 * GemmTile<BT>::kWordStride * 4;  // scales [kQ][kCols]
  static constexpr int kZ = kS + kQ * kCols * 2;                      // zeros [kQ][kCols]
  static constexpr int kBytes = (kZ + kQ * kCols * 2 + 1023) / 1024 * 1024;
};

template <int BT, bool PQ>
constexpr size_t gemm_smem_bytes() {  // the stages, their two mbarriers, and room to align
  return static_cast<size_t>(GemmStage<BT, PQ>::kBytes + 16) * gemm_stages<BT>() + 1024;
}
// The largest stage set fits the H200's 227 KB of shared memory per block.
static_assert(gemm_smem_bytes<256, true>() <= 227 * 1024);

// This thread's index among the consumer warpgroups' threads.
__device__ inline int consumer_thread() {
  return static_cast<int>(threadIdx.x) - kProducerThreads;
}

// --- wgmma (sm_90a)

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Pin registers at this point of the program (the compiler must not move their reads or writes
// across a wgmma fence or wait, which it cannot see through).
template <int N>
__device__ inline void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ inline void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled operand starting at byte
// address `addr`: 8-row core groups 1024 bytes apart.
__device__ inline uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PAGEDQ_WGMMA
#endif

// The operand lists of wgmma m64nNk16 with f32 accumulators: N / 2 per thread.
#define PAGEDQ_ACC8(d, i)                                                                    \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define PAGEDQ_ACC32(d) PAGEDQ_ACC8(d, 0), PAGEDQ_ACC8(d, 8), PAGEDQ_ACC8(d, 16), PAGEDQ_ACC8(d, 24)
#define PAGEDQ_ACC64(d) \
  PAGEDQ_ACC32(d), PAGEDQ_ACC8(d, 32), PAGEDQ_ACC8(d, 40), PAGEDQ_ACC8(d, 48), PAGEDQ_ACC8(d, 56)
#define PAGEDQ_ACC128(d)                                                                   \
  PAGEDQ_ACC64(d), PAGEDQ_ACC8(d, 64), PAGEDQ_ACC8(d, 72), PAGEDQ_ACC8(d, 80),                \
      PAGEDQ_ACC8(d, 88), PAGEDQ_ACC8(d, 96), PAGEDQ_ACC8(d, 104), PAGEDQ_ACC8(d, 112),        \
      PAGEDQ_ACC8(d, 120)
#define PAGEDQ_REGS32                                                                            \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PAGEDQ_REGS64                                                                            \
  PAGEDQ_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, " \
                "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
                "%62, %63"
#define PAGEDQ_REGS128                                                                           \
  PAGEDQ_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, " \
                "%79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, "  \
                "%94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, "     \
                "%107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, "     \
                "%119, %120, %121, %122, %123, %124, %125, %126, %127"
// acc (+)= A B: A from registers a[0..3], B from descriptor b; the predicate from `keep` picks
// accumulate (1) or overwrite (0). REGS / A / B / KEEP name the operands' PTX numbers; the
// accumulator operands come last.
#define PAGEDQ_WGMMA_RS(SHAPE, TYPE, REGS, A, B, KEEP, ...)                                  \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, " KEEP ", 0; wgmma.mma_async.sync.aligned." SHAPE \
               ".f32." TYPE "." TYPE " {" REGS "}, {" A "}, " B ", p, 1, 1, 0; }"          \
               : __VA_ARGS__                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(keep))

// Wgmma<T, BT>::run: acc (+)= A B for tiles of BT tokens (wgmma m64nBTk16); keep = 0: acc = A B
// (the first k16 slice of a tile).
template <typename T, int BT>
struct Wgmma;
#define PAGEDQ_WGMMA_TILE(BT, REGS, A, B, KEEP, ...)                                          \
  template <typename T>                                                                       \
  struct Wgmma<T, BT> {                                                                       \
    __device__ static void run(float (&d)[BT / 2], const uint32_t (&a)[4], uint64_t b,       \
                               uint32_t keep) {                                               \
      if constexpr (std::is_same_v<T, __half>) {                                             \
        PAGEDQ_WGMMA_RS("m64n" #BT "k16", "f16", REGS, A, B, KEEP, __VA_ARGS__);              \
      } else {                                                                                \
        PAGEDQ_WGMMA_RS("m64n" #BT "k16", "bf16", REGS, A, B, KEEP, __VA_ARGS__);             \
      }                                                                                       \
    }                                                                                         \
  };
PAGEDQ_WGMMA_TILE(64, PAGEDQ_REGS32, "%32, %33, %34, %35", "%36", "%37", PAGEDQ_ACC32(d))
PAGEDQ_WGMMA_TILE(128, PAGEDQ_REGS64, "%64, %65, %66, %67", "%68", "%69", PAGEDQ_ACC64(d))
PAGEDQ_WGMMA_TILE(256, PAGEDQ_REGS128, "%128, %129, %130, %131", "%132", "%133", PAGEDQ_ACC128(d))

// --- stage copies: bulk copies whose completion the stage's mbarrier counts in bytes

__device__ inline void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ inline void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}
__device__ inline void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{ .reg .pred done;\n"
      "WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT; }" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16) from global `src` to shared `dst`, both 16-byte aligned.
__device__ inline void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// The box at (k, row) of the tensor map (x: 64 k x BT rows, 128-byte swizzle, zeros outside).
__device__ inline void tensor_copy(void* dst, const void* map, int k, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];" ::"r"(smem_addr(dst)),
      "l"(map), "r"(k), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

// Bytes one stage receives for column tile n0.
template <int BT, bool PQ, bool Z>
__device__ inline uint32_t stage_bytes(const GemmParams& p, int n0) {
  constexpr int kCols = GemmTile<BT>::kCols;
  const int cols = p.N - n0 < kCols ? p.N - n0 : kCols;
  return 16 * cols * 4 + GemmStage<BT, PQ>::kQ * cols * 2 * (Z ? 2 : 1) + 2 * BT * 128;
}

// Issue block b of tile (m0, n0) into stage `st`: the weights, scales and zeros (with_w), and/or
// x (with_x). One thread (the producer) issues them all. Columns past N are not copied (their
// sums are never stored).
template <int BT, bool PQ, bool Z>
__device__ inline void gemm_issue(const GemmParams& p, const void* x_map, unsigned char* st,
                                  uint64_t* bar, int m0, int n0, int b, bool with_w, bool with_x) {
  using S = GemmStage<BT, PQ>;
  const int cols = p.N - n0 < S::kCols ? p.N - n0 : S::kCols;
  if (with_w) {
    mbar_expect(bar, stage_bytes<BT, PQ, Z>(p, n0));
    const int32_t* w = p.qweight + static_cast<int64_t>(b) * 16 * p.N + n0;
#pragma unroll 4
    for (int r = 0; r < 16; ++r) {
      bulk_copy(st + S::kW + r * GemmTile<BT>::kWordStride * 4, w + r * p.N, cols * 4, bar);
    }
#pragma unroll
    for (int q = 0; q < S::kQ; ++q) {
      const int64_t at = group_row(p, b, q) * p.N + n0;
      bulk_copy(st + S::kS + q * S::kCols * 2, static_cast<const uint16_t*>(p.scales) + at,
                cols * 2, bar);
      if constexpr (Z) {
        bulk_copy(st + S::kZ + q * S::kCols * 2, static_cast<const uint16_t*>(p.zeros) + at,
                  cols * 2, bar);
      }
    }
  }
  if (with_x) {
    tensor_copy(st, x_map, b * kBlockK, m0, bar);
    tensor_copy(st + S::kXHalf, x_map, b * kBlockK + 64, m0, bar);
  }
}

// Part `part` of a block (kParts parts of 4 / kParts nibble quarters): dequantize its k16 slices
// (p, s) into `a` [slice][mt] and issue their wgmmas.
template <typename T, int BT, bool PQ, bool Z, int kParts>
__device__ inline void gemm_part(const unsigned char* st, uint32_t x_addr, int part,
                                 uint32_t (&a)[8 / kParts][GemmTile<BT>::kMT][4],
                                 float (&acc)[GemmTile<BT>::kMT][BT / 2],
                                 bool fresh) {
  using S = GemmStage<BT, PQ>;
  constexpr uint32_t kMagic = Dtype<T>::kMagicBits;
  constexpr int kQuarters = 4 / kParts;
  const int c = consumer_thread(), lane = c % 32, g = lane / 4, t = lane % 4;
  constexpr int kMT = GemmTile<BT>::kMT, kStride = GemmTile<BT>::kWordStride;
  const int col = 64 * kMT * (c / 128) + 16 * (c / 32 % 4) + 2 * g;  // + 64 mt
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    uint2 w[4];  // word rows t + 4j, columns col + 64 mt + (0, 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = *reinterpret_cast<const uint2*>(st + S::kW +
                                             ((t + 4 * j) * kStride + col + 64 * mt) * 4);
    }
#pragma unroll
    for (int pp = 0; pp < kQuarters; ++pp) {
      const int p = kQuarters * part + pp, q = PQ ? p : 0;
      const int at = (q * S::kCols + col + 64 * mt) * 2;
      const uint32_t s2 = *reinterpret_cast<const uint32_t*>(st + S::kS + at);
      const uint32_t z2 = Z ? *reinterpret_cast<const uint32_t*>(st + S::kZ + at) : 0u;
      uint32_t sc[2], zb[2];  // columns col + e: the scale and MAGIC + z' (odd fp16 p: -(64 + z'))
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[e] = __byte_perm(s2, 0, e == 0 ? 0x1010 : 0x3232);
        const uint32_t z = __byte_perm(z2, 0, e == 0 ? 0x1010 : 0x3232);
        if (Dtype<T>::kHighNibbles && p % 2 == 1) {
          zb[e] = Z ? fma2<T>(z, 0xBC00BC00u, 0xD400D400u) : 0xD480D480u;
        } else {
          zb[e] = Z ? add2<T>(kMagic, z) : kMagic + 0x00080008u;
        }
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // A reg r: word row 8s + t (+ 4 for r >= 2), column e
          const int e = r % 2;
          const uint32_t word = e == 0 ? w[2 * s + r / 2].x : w[2 * s + r / 2].y;
          uint32_t d;
          if constexpr (Dtype<T>::kHighNibbles) {
            const uint32_t src = p >= 2 ? word >> 8 : word;
            d = p % 2 == 0 ? sub2<T>(nibble_pair(src, kMagic), zb[e])
                           : fma2<T>(nibble_pair_hi(src, kMagic), 0x2C002C00u, zb[e]);
          } else {
            d = sub2<T>(nibble_pair(word >> (4 * p), kMagic), zb[e]);
          }
          a[2 * pp + s][mt][r] = mul2<T>(d, sc[e]);
        }
      }
    }
  }
#pragma unroll
  for (int sl = 0; sl < 8 / kParts; ++sl) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) fence_regs(a[sl][mt]);
  }
  wgmma_fence();
#pragma unroll
  for (int sl = 0; sl < 8 / kParts; ++sl) {  // slice (p, s): x half p / 2, bytes 64 (p % 2) + 32 s
    const int p = kQuarters * part + sl / 2, s = sl % 2;
    const uint64_t desc = smem_desc(x_addr + (p / 2) * S::kXHalf + 64 * (p % 2) + 32 * s);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      Wgmma<T, BT>::run(acc[mt], a[sl][mt], desc, !(fresh && sl == 0));
    }
  }
  wgmma_commit();
}

// Store the tile's sums (+ bias) to out: lane (g, t) holds columns col, col + 1 (A rows g, g + 8)
// for tokens 8j + 2t (+ 1).
template <typename T, int BT>
__device__ inline void gemm_write(const GemmParams& p, int m0, int n0,
                                  const float (&acc)[GemmTile<BT>::kMT][BT / 2], int lo = 0,
                                  int hi = GemmTile<BT>::kPieces) {
  constexpr int kMT = GemmTile<BT>::kMT;
  const int c = consumer_thread(), lane = c % 32, g = lane / 4, t = lane % 4;
  const int col0 = n0 + 64 * kMT * (c / 128) + 16 * (c / 32 % 4) + 2 * g;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int col = col0 + 64 * mt;
    if (col >= p.N) continue;
    float b0 = 0.f, b1 = 0.f;
    if (p.bias != nullptr) {
      b0 = Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[col]);
      b1 = Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[col + 1]);
    }
#pragma unroll
    for (int i = 0; i < BT / 8; ++i) {
      const int v = mt * (BT / 8) + i;  // the piece (gemm_slot) of acc[mt][4i..4i+3]
      if (v < lo || v >= hi) continue;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + 8 * i + 2 * t + e;
        if (m >= p.M) continue;
        const uint32_t lo = Dtype<T>::from_float(acc[mt][4 * i + e] + b0);
        const uint32_t hi = Dtype<T>::from_float(acc[mt][4 * i + 2 + e] + b1);
        uint16_t* at = static_cast<uint16_t*>(p.out) + static_cast<int64_t>(m) * p.N + col;
        *reinterpret_cast<uint32_t*>(at) = lo | (hi << 16);
      }
    }
  }
}

// Values 4v..4v+3 of this thread's accumulators in workspace slot `cta` (16-byte pieces in
// fragment order: coalesced).
template <int BT>
__device__ inline float* gemm_slot(const GemmParams& p, int cta, int v) {
  const int64_t piece = static_cast<int64_t>(cta) * GemmTile<BT>::kPieces + v;
  return p.workspace + (piece * kGemmThreads + consumer_thread()) * 4;
}

// Add pieces [v0, v0 + 8) of CTA c's slot that lie in [lo, hi) to acc as they land, and empty
// them. Every round re-reads all the pieces still empty at once: polling them one at a time cost
// a round trip per piece when the reader got there first (H200, M=256, per layer: stream-K qkv
// 59.2 -> 53.4 µs, down split in 4 exact parts 55.8 -> 51.4). Slower on the H200 (M=256 stack,
// bench/results/gptq_w4a_2026-11-30r_notes.md): 16 pieces per round, all pieces at once through
// shared memory, sleeping between rounds, and clusters of two CTAs trading halves of the tile.
template <int BT>
__device__ inline void add_slot(const GemmParams& p, int c, int v0, int lo, int hi,
                                float (&acc)[GemmTile<BT>::kMT][BT / 2]) {
  constexpr int kAhead = 8;  // 16-byte reads in flight
  uint32_t pending = 0;
#pragma unroll
  for (int u = 0; u < kAhead; ++u) {
    if (v0 + u >= lo && v0 + u < hi) pending |= 1u << u;
  }
  while (pending != 0) {
    uint4 got[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (pending >> u & 1) got[u] = load_slot4(gemm_slot<BT>(p, c, v0 + u));
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (!(pending >> u & 1) || any_empty(got[u])) {
        continue;  // a piece may land in parts: it counts once whole
      }
      const int i = 4 * (v0 + u);  // value i..i+3: accumulator (i / (BT / 2), i % (BT / 2))
      float* dst = &acc[i / (BT / 2)][i % (BT / 2)];
      dst[0] += __uint_as_float(got[u].x);
      dst[1] += __uint_as_float(got[u].y);
      dst[2] += __uint_as_float(got[u].z);
      dst[3] += __uint_as_float(got[u].w);
      const float empty = __uint_as_float(kEmpty);
      store_slot4(gemm_slot<BT>(p, c, v0 + u), empty, empty, empty, empty);
      pending &= ~(1u << u);
    }
  }
}

// The owner of split tile `tile` adds the other contributors' slots in CTA order (the sum does
// not depend on timing).
template <int BT>
__device__ inline void gemm_finish(const GemmParams& p, int tile,
                                   float (&acc)[GemmTile<BT>::kMT][BT / 2], const Split& split) {
  int first, last;
  split.contributors(tile, first, last);
  for (int c = first + 1; c <= last; ++c) {
#pragma unroll
    for (int v0 = 0; v0 < GemmTile<BT>::kPieces; v0 += 8) {
      add_slot<BT>(p, c, v0, 0, GemmTile<BT>::kPieces, acc);
    }
  }
}

// An exact split (p.split = k > 1): the CTA's part of its tile is all it computed. It stores
// the pieces of the other k - 1 shares to its slot, adds the other CTAs' pieces of its own share
// in CTA order, and writes its share of the output. Each CTA reads (k - 1) / k of a partial
// tile, where an owner would read k - 1 partial tiles.
template <typename T, int BT>
__device__ inline void gemm_share(const GemmParams& p, int m0, int n0,
                                  float (&acc)[GemmTile<BT>::kMT][BT / 2]) {
  constexpr int kPieces = GemmTile<BT>::kPieces;
  const int k = p.split, first = static_cast<int>(blockIdx.x) / k * k;
  const int j = static_cast<int>(blockIdx.x) - first;
  const int lo = j * kPieces / k, hi = (j + 1) * kPieces / k;
#pragma unroll
  for (int v = 0; v < kPieces; ++v) {
    if (v >= lo && v < hi) continue;
    const float* src = &acc[4 * v / (BT / 2)][4 * v % (BT / 2)];
    store_slot4(gemm_slot<BT>(p, blockIdx.x, v), src[0], src[1], src[2], src[3]);
  }
  for (int c = first; c < first + k; ++c) {
    if (c == static_cast<int>(blockIdx.x)) continue;
#pragma unroll
    for (int v0 = 0; v0 < kPieces; v0 += 8) {
      if (v0 < hi && v0 + 8 > lo) add_slot<BT>(p, c, v0, lo, hi, acc);
    }
  }
  gemm_write<T, BT>(p, m0, n0, acc, lo, hi);
}

template <typename T, int BT, bool PQ, bool Z>
__device__ inline void gemm_body(const GemmParams& p, const void* x_map) {
  using S = GemmStage<BT, PQ>;
  constexpr int kStages = gemm_stages<BT>();
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  const uint32_t raw = smem_addr(gemm_smem);
  unsigned char* ring = gemm_smem + ((1024 - raw % 1024) % 1024);  // swizzle atoms: 1024-aligned
  const uint32_t ring_addr = smem_addr(ring);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kStages * S::kBytes);  // item landed
  uint64_t* empty = full + kStages;  // stage consumed by both warpgroups (a lane per warp)

  // item indices are int: the items are < 2^31 (checked at launch)
  const Split split(p.tiles_n * p.tiles_m, p.num_blocks, 1, gridDim.x);
  const int begin = static_cast<int>(split.begin(blockIdx.x));
  const int count = static_cast<int>(split.end(blockIdx.x)) - begin;
  // item -> tile (column tile-major, token tiles adjacent), block
  auto where = [&](int item, int& m0, int& n0, int& b) {
    const int tile = item / p.num_blocks;
    b = item - tile * p.num_blocks;
    m0 = tile % p.tiles_m * BT;
    n0 = tile / p.tiles_m * GemmTile<BT>::kCols;
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 2 * kWarps);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the inits, for the copies
  }
  __syncthreads();
  pdl_launch_dependents();

  if (threadIdx.x < kProducerThreads) {  // --- the producer warpgroup: one thread copies
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
    if (threadIdx.x == 0) {
      const int first = count < kStages ? count : kStages;
      for (int j = 0; j < first; ++j) {  // weights before waiting for the previous kernel
        int m0, n0, b;
        where(begin + j, m0, n0, b);
        gemm_issue<BT, PQ, Z>(p, x_map, ring + j * S::kBytes, &full[j], m0, n0, b, true, false);
      }
      pdl_wait();  // x is the previous kernel's output
      for (int j = 0; j < count; ++j) {
        int m0, n0, b;
        where(begin + j, m0, n0, b);
        const int st = j % kStages;
        if (j >= kStages) mbar_wait(&empty[st], (j / kStages - 1) & 1);  // its last use is done
        gemm_issue<BT, PQ, Z>(p, x_map, ring + st * S::kBytes, &full[st], m0, n0, b,
                              j >= kStages, true);
      }
    }
    return;
  }

  // --- the consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
  pdl_wait();  // out and the workspace may be the previous kernel's inputs
  constexpr int kMT = GemmTile<BT>::kMT;
  float acc[kMT][BT / 2];  // written by wgmma only: a tile's first slice overwrites it
  // Two register sets of A fragments (block halves): one half's wgmmas run while the other is
  // dequantized (H200: four quarter sets were slower).
  constexpr int kParts = 2;
  uint32_t a[kParts][8 / kParts][kMT][4];  // [register set = block part][slice][mt][reg]
  int seg_first = 0;       // the current segment's first block
  int owned = -1;          // the split tile this CTA finishes
  bool fresh = true;       // the next block starts a segment
  const bool releaser = consumer_thread() % 32 == 0;
  for (int i = 0;; ++i) {  // count >= 1 (ctas <= items); the loop ends at a flush (wgmma drained)
    mbar_wait(&full[i % kStages], (i / kStages) & 1);  // item i has landed
    int m0, n0, b;
    where(begin + i, m0, n0, b);
    if (i == 0) seg_first = b;
    const unsigned char* st = ring + (i % kStages) * S::kBytes;
    const uint32_t x_addr = ring_addr + (i % kStages) * S::kBytes;
#pragma unroll
    for (int h = 0; h < kParts; ++h) {
      wgmma_wait<kParts - 1>();  // the wgmmas that read register set h (a block ago) are done
      if (h == kParts - 1 && i > 0 && releaser) mbar_arrive(&empty[(i - 1) % kStages]);
#pragma unroll
      for (int sl = 0; sl < 8 / kParts; ++sl) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) fence_regs(a[h][sl][mt]);
      }
      gemm_part<T, BT, PQ, Z, kParts>(st, x_addr, h, a[h], acc, fresh && h == 0);
    }
    fresh = false;
    if (b == p.num_blocks - 1 || i == count - 1) {  // the segment ends: flush the tile
      wgmma_wait<0>();
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) fence_regs(acc[mt]);
      const int tile = (begin + i) / p.num_blocks;
      const bool whole = seg_first == 0 && b == p.num_blocks - 1;
      if (whole) {
        gemm_write<T, BT>(p, m0, n0, acc);
      } else if (seg_first == 0 || p.split > 1) {
        owned = tile;  // the CTA's last segment, or an exact split's only one: finished below
      } else {
#pragma unroll
        for (int v = 0; v < GemmTile<BT>::kPieces; ++v) {
          const float* src = &acc[4 * v / (BT / 2)][4 * v % (BT / 2)];
          store_slot4(gemm_slot<BT>(p, blockIdx.x, v), src[0], src[1], src[2], src[3]);
        }
      }
      if (i == count - 1) break;
      fresh = true;
      seg_first = 0;  // later segments start at block 0
    }
  }
  if (owned >= 0) {  // after the loop: the A fragments are dead
    int m0, n0, b;
    where(owned * p.num_blocks, m0, n0, b);
    if (p.split > 1) {  // an exact split: the tile of the CTA's only segment
      gemm_share<T, BT>(p, m0, n0, acc);
    } else {
      gemm_finish<BT>(p, owned, acc, split);
      gemm_write<T, BT>(p, m0, n0, acc);
    }
  }
}

template <typename T, int BT, bool PQ>
__global__ void __launch_bounds__(kGemmBlock, 1)
    gptq_gemm_kernel(const GemmParams p, const __grid_constant__ CUtensorMap x_map) {
#ifdef PAGEDQ_WGMMA  // sm_90a only (wgmma, TMA, setmaxnreg); the op refuses other GPUs
  if (p.zeros != nullptr) {
    gemm_body<T, BT, PQ, true>(p, &x_map);
  } else {
    gemm_body<T, BT, PQ, false>(p, &x_map);
  }
#else
  __trap();  // built for another architecture with the rest of the extension (the GEMV)
#endif
}

}  // namespace gptq
}  // namespace pagedq
