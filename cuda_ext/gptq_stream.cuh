// GPTQ 4-bit matmul for small batches (M <= 16) on tensor cores, streaming the weights once.
//
// out[m, n] = sum_k x[m, k] * (q[k, n] - z'[g, n]) * s[g, n] (+ bias[n]), fp32 accumulation.
// Layout and dequantization as in gptq_gemv.cuh (same PackedGPTQWeight): qweight [Kp/8, N] int32
// in 128-row blocks, nibble p + 4h of word row 16b + r = input row 128b + 32p + 2r + h.
//
// Work: the weight is cut into items = (column tile of kTileN = 64 columns, 128-row block), in
// tile-major order. The grid is persistent (about one CTA per resident slot) and CTA c takes the
// contiguous item range [c * items / C, (c + 1) * items / C) ("stream-K"), so every SM streams the
// same number of bytes whatever the layer's shape. A CTA walks its range one tile segment at a
// time; its warps take the segment's blocks in turn and each keeps the next block's loads in
// flight while it computes the current one.
//
// Warp tile: lane (g, t) = (lane / 4, lane % 4) loads word row 4t + j (j = 0..3) of columns
// 4g..4g+3 and 32+4g..32+4g+3 (two 16-byte loads: every warp load is 4 rows x 2 x 128 bytes).
// mma.m16n8k16 with the weights as A: the 16 A rows are columns {4g + c, 32 + 4g + c} of n-tile
// c = 0..3; A's k pairs (2t, 2t+8) are the word's nibble pairs (2pp, 2pp+1), which hold input rows
// 32p + 8t + 2j + h, so B (activations, 8 tokens per n8 tile) is x[token][32p + 8t .. + 7]: one
// 16-byte load per (p, token tile) per block. One mma per weight word.
//
// Partial tiles (a tile split between CTAs) go to workspace slot tile + cta (unique: along the
// staircase of (tile, cta) pairs both only grow); the last of a tile's contributors to arrive
// (counter in locks) sums the slots in CTA order, so results do not depend on timing.
//
// With PDL (programmatic dependent launch) each CTA lets the next kernel launch at once and
// issues its first weight loads before waiting for the previous kernel's results: x, out,
// workspace and locks are only touched after the wait.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedq {
namespace stream {

constexpr int kBlockK = 128;  // input rows per packed block
constexpr int kTileN = 64;    // output columns per tile (one warp covers all of them)
constexpr int kWarps = 4;     // warps per CTA
constexpr int kThreads = kWarps * 32;

template <typename T>
struct Dtype;

template <>
struct Dtype<__half> {
  static constexpr uint32_t kMagicBits = 0x64006400u;  // fp16 (1024, 1024)
  static constexpr float kMagic = 1024.0f;
  __device__ static float to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  __device__ static uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static uint32_t sub_mul(uint32_t a, uint32_t b, uint32_t s) {
    const __half2 r = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&a),
                                      *reinterpret_cast<const __half2*>(&b)),
                              *reinterpret_cast<const __half2*>(&s));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static uint32_t sub(uint32_t a, uint32_t b) {
    const __half2 r =
        __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static uint32_t add(uint32_t a, uint32_t b) {
    const __half2 r =
        __hadd2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Dtype<__nv_bfloat16> {
  static constexpr uint32_t kMagicBits = 0x43004300u;  // bf16 (128, 128)
  static constexpr float kMagic = 128.0f;
  __device__ static float to_float(uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  __device__ static uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  __device__ static uint32_t sub_mul(uint32_t a, uint32_t b, uint32_t s) {
    const __nv_bfloat162 r = __hmul2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                             *reinterpret_cast<const __nv_bfloat162*>(&b)),
                                     *reinterpret_cast<const __nv_bfloat162*>(&s));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static uint32_t sub(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static uint32_t add(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

struct Params {
  const void* x;           // [M, K] T, row stride x_stride (elements), 16-byte aligned rows
  const int32_t* qweight;  // [Kp/8, N]
  const void* scales;      // [G, N] T
  const void* zeros;       // [G, N] T (z'), or nullptr: every z' is 8
  const void* bias;        // [N] T or nullptr
  void* out;               // [M, N] T contiguous
  float* workspace;        // [tiles + ctas, M, kTileN] fp32 partial tiles
  int32_t* locks;          // [>= tiles] arrival counters, zero between launches
  int64_t x_stride;
  int M, N, K;
  int group_size, num_groups;
  int tiles, num_blocks;   // ceil(N / kTileN), ceil(K / kBlockK)
  int tma = 0;             // dev: weights through TMA bulk copies (1) or cp.async (0)
  int l2pf = 0;            // dev: cp.async L2 prefetch size: 0 none, 1 128B, 2 256B
  int mode = 0;            // dev: 1 loads only, 2 math only (timing experiments only)
  int tiled;               // dev: qweight as [tiles, Kp/8, kTileN] (timing experiments only)
};

// One warp's loads for one block: 32 weight words per lane, its scales/zeros, and activations.
template <int MT, bool PQ>
struct Stage {
  static constexpr int kQ = PQ ? 4 : 1;  // scale rows per block: per quarter p, or one
  uint4 words[4][2];  // [j][h]: word row 4t + j, columns 4g.. (h = 0) / 32 + 4g.. (h = 1)
  uint4 x[MT][4];     // [token tile][p]: x[8 tt + g][128 b + 32 p + 8 t .. + 7]
  uint2 scale[2][kQ];  // [h][q]: the 4 columns' scales (q: quarter p, or the whole block)
  uint2 zero[2][kQ];   // MAGIC + z' of the same (MAGIC + 8 without zeros)
};

// One warp's ring slot for one Stage: lane-interleaved (entry e of lane l at e * 32 + l), so
// the lanes' 16-byte (8-byte) reads of one entry are conflict-free; each lane reads back only
// what it wrote, so the ring needs cp.async waits but no barriers.
template <int TOK, bool PQ>
struct Slot {
  static constexpr int kMT = TOK > 8 ? 2 : 1;     // 8-token tiles
  static constexpr int kTPT = TOK < 8 ? TOK : 8;  // tokens per tile: lanes g < kTPT hold x
  static constexpr int kQ = Stage<kMT, PQ>::kQ;
  static constexpr int kWordBytes = 16 * 256 + 3 * 32 + 32;  // 16 word rows, see word_offset
  uint64_t bar;                // mbarrier of the TMA weight copies (tx count = their bytes)
  uint64_t pad;
  alignas(16) unsigned char words[kWordBytes];
  uint4 x[4 * kMT][4 * kTPT];  // lane g * 4 + t (g < kTPT)
  uint2 params[4 * kQ][32];  // scale[h][q] at 2 (h kQ + q), zero at 2 (h kQ + q) + 1
};

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of word row r (256 bytes: 64 columns) in a slot: rows 4t + j of the 4 t lanes
// of one 8-lane phase land 32 bytes apart mod 128, so the lanes' 16-byte reads are conflict-free.
__device__ inline int word_offset(int r) { return 256 * r + 32 * (r / 4); }

__device__ inline void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
}
__device__ inline void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ inline void mbar_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(phase)
        : "memory");
  }
}
// One TMA bulk copy global -> shared, completing `bytes` on bar's transaction count.
__device__ inline void tma_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// cp.async of `bytes` (16 or 8) from src, zero-filled when !valid (src is not read then).
template <int kBytes>
__device__ inline void cp_async(void* dst, const void* src, bool valid, int l2pf = 0) {
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    if (l2pf == 2) {
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)),
                   "l"(src), "r"(src_bytes));
    } else if (l2pf == 1) {
      asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)),
                   "l"(src), "r"(src_bytes));
    } else {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                   "r"(src_bytes));
    }
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
  }
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

__device__ inline uint4 ld_stream(const int32_t* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ inline void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ inline void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Where this lane's loads of block b come from (nullptr/invalid entries read as zeros).
struct Sources {
  const int32_t* words[2];  // word row 4t of columns 4g (+ 32 h); rows j at + j N
  bool col_ok[2];
};

__device__ inline Sources sources(const Params& p, int tile, int b) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  Sources src;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int col = tile * kTileN + 32 * h + 4 * g;
    src.col_ok[h] = col < p.N;  // N % 8 == 0: the 4 columns exist together
    src.words[h] = p.tiled ? p.qweight + ((static_cast<int64_t>(tile) * p.num_blocks + b) * 16 + 4 * t) * kTileN + 32 * h + 4 * g
                           : p.qweight + (static_cast<int64_t>(b) * 16 + 4 * t) * p.N + col;
  }
  return src;
}

// Group row of quarter q of block b (q = 0 for block-wide groups), clamped for padded rows.
__device__ inline int64_t group_row(const Params& p, int b, int q) {
  const int grp = (b * kBlockK + 32 * q) / p.group_size;
  return grp < p.num_groups - 1 ? grp : p.num_groups - 1;
}

__device__ inline const void* x_src(const Params& p, int b, int tt, int q, bool& valid) {
  const int lane = threadIdx.x % 32;
  const int m = 8 * tt + lane / 4;
  const int k = b * kBlockK + 32 * q + 8 * (lane % 4);
  valid = m < p.M && k < p.K;  // K % 8 == 0: 8 rows exist together
  return valid ? static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(m) * p.x_stride + k
               : p.x;
}

// Issue this lane's cp.asyncs of block b into `slot` (weights; activations if with_x).
template <int TOK, bool PQ>
__device__ inline void issue_slot(const Params& p, int tile, int b, Slot<TOK, PQ>& slot,
                                  bool with_weights, bool with_x) {
  constexpr int MT = Slot<TOK, PQ>::kMT;
  const int lane = threadIdx.x % 32;
  if (with_weights) {
    const Sources src = sources(p, tile, b);
    if (p.tma) {
      // one 256-byte row (fewer at the last tile) per lane 0..15, all on the slot's mbarrier
      const int cols = p.N - tile * kTileN < kTileN ? p.N - tile * kTileN : kTileN;
      const uint32_t row_bytes = 4u * cols;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // slot was read generically
      __syncwarp();
      if (lane == 0) mbar_expect(&slot.bar, 16 * row_bytes);
      if (lane < 16) {
        const int32_t* row =
            p.tiled ? p.qweight + ((static_cast<int64_t>(tile) * p.num_blocks + b) * 16 + lane) * kTileN
                    : p.qweight + (static_cast<int64_t>(b) * 16 + lane) * p.N + tile * kTileN;
        tma_copy(slot.words + word_offset(lane), row, row_bytes, &slot.bar);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 4 && !p.tma; ++j) {
        cp_async<16>(slot.words + word_offset(4 * (lane % 4) + j) + 16 * (lane / 4) + 128 * h,
                     src.words[h] + static_cast<int64_t>(j) * (p.tiled ? kTileN : p.N),
                     src.col_ok[h], p.l2pf);
      }
#pragma unroll
      for (int q = 0; q < Slot<TOK, PQ>::kQ; ++q) {
        const int64_t at = group_row(p, b, q) * p.N + tile * kTileN + 32 * h + 4 * ((lane) / 4);
        const int e = 2 * (h * Slot<TOK, PQ>::kQ + q);
        cp_async<8>(&slot.params[e][lane], static_cast<const uint16_t*>(p.scales) + at,
                    src.col_ok[h]);
        if (p.zeros != nullptr) {
          cp_async<8>(&slot.params[e + 1][lane], static_cast<const uint16_t*>(p.zeros) + at,
                      src.col_ok[h]);
        }
      }
    }
  }
  if (with_x && lane / 4 < Slot<TOK, PQ>::kTPT) {
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        bool valid;
        const void* src = x_src(p, b, tt, q, valid);
        cp_async<16>(&slot.x[4 * tt + q][lane], src, valid);
      }
    }
  }
}

template <int TOK, bool PQ>
__device__ inline void read_slot(const Params& p, Slot<TOK, PQ>& slot, uint32_t phase,
                                 Stage<Slot<TOK, PQ>::kMT, PQ>& s) {
  constexpr int MT = Slot<TOK, PQ>::kMT;
  const int lane = threadIdx.x % 32;
  const bool has_x = lane / 4 < Slot<TOK, PQ>::kTPT;
  if (p.tma) mbar_wait(&slot.bar, phase);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s.words[j][h] = *reinterpret_cast<const uint4*>(
          slot.words + word_offset(4 * (lane % 4) + j) + 16 * (lane / 4) + 128 * h);
    }
  }
#pragma unroll
  for (int tt = 0; tt < MT; ++tt) {
#pragma unroll
    for (int q = 0; q < 4; ++q) s.x[tt][q] = has_x ? slot.x[4 * tt + q][lane] : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < Stage<MT, PQ>::kQ; ++q) {
      const int e = 2 * (h * Stage<MT, PQ>::kQ + q);
      s.scale[h][q] = slot.params[e][lane];
      s.zero[h][q] = p.zeros != nullptr ? slot.params[e + 1][lane] : make_uint2(0, 0);
    }
  }
}

__device__ inline uint32_t lop_and_or(uint32_t bits, uint32_t magic) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "n"(0x000F000F), "r"(magic));
  return out;
}

__device__ inline uint32_t word_of(const uint4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

__device__ inline uint32_t half_of(const uint2& v, int c) {
  // element c of 4 packed 16-bit values, duplicated into both halves (one PRMT)
  return __byte_perm(c < 2 ? v.x : v.y, 0, c % 2 == 0 ? 0x1010 : 0x3232);
}

// acc[tt][c] += this block's products (n-tile c, token tile tt). With one group per block
// (!PQ) the mma runs on the exact integers q - z' and the fp32 block sums are scaled once.
template <typename T, int MT, bool PQ>
__device__ inline void compute(const Stage<MT, PQ>& s, bool has_zeros, float (&acc)[MT][4][4]) {
  constexpr uint32_t kMagic = Dtype<T>::kMagicBits;
  constexpr uint32_t kDefaultZero = kMagic + 0x00080008u;  // MAGIC + 8 in both halves, exact
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t zb[2][4], sc[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int qi = PQ ? q : 0;
        sc[h][q] = half_of(s.scale[h][qi], c);
        // MAGIC + z' is exact: z' <= 16 lands on an integer step of MAGIC's binade
        zb[h][q] = has_zeros ? Dtype<T>::add(kMagic, half_of(s.zero[h][qi], c)) : kDefaultZero;
      }
    }
    float part[MT][4] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w0 = word_of(s.words[j][0], c);
      const uint32_t w1 = word_of(s.words[j][1], c);
      uint32_t deq[2][4];  // [h][p]: rows (32p + 8t + 2j, + 1) of column 4g + c (+ 32 h)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t b0 = lop_and_or(w0 >> (4 * q), kMagic);
        const uint32_t b1 = lop_and_or(w1 >> (4 * q), kMagic);
        if constexpr (PQ) {
          deq[0][q] = Dtype<T>::sub_mul(b0, zb[0][q], sc[0][q]);
          deq[1][q] = Dtype<T>::sub_mul(b1, zb[1][q], sc[1][q]);
        } else {
          deq[0][q] = Dtype<T>::sub(b0, zb[0][q]);
          deq[1][q] = Dtype<T>::sub(b1, zb[1][q]);
        }
      }
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const uint32_t a[4] = {deq[0][2 * pp], deq[1][2 * pp], deq[0][2 * pp + 1],
                               deq[1][2 * pp + 1]};
#pragma unroll
        for (int tt = 0; tt < MT; ++tt) {
          Dtype<T>::mma(PQ ? acc[tt][c] : part[tt], a, word_of(s.x[tt][2 * pp], j),
                        word_of(s.x[tt][2 * pp + 1], j));
        }
      }
    }
    if constexpr (!PQ) {
      const float s0 = Dtype<T>::to_float(static_cast<uint16_t>(sc[0][0]));  // column 4g + c
      const float s1 = Dtype<T>::to_float(static_cast<uint16_t>(sc[1][0]));  // column 32 + 4g + c
#pragma unroll
      for (int tt = 0; tt < MT; ++tt) {
        acc[tt][c][0] += part[tt][0] * s0;
        acc[tt][c][1] += part[tt][1] * s0;
        acc[tt][c][2] += part[tt][2] * s1;
        acc[tt][c][3] += part[tt][3] * s1;
      }
    }
  }
}

// Sum the warps' accumulators into red[token][col] (kWarps x [8 MT][kTileN] fp32 in smem).
template <int MT>
__device__ inline void reduce_warps(const float (&acc)[MT][4][4], float* red) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr int kPlane = 8 * MT * kTileN;
  float* mine = red + warp * kPlane;
#pragma unroll
  for (int tt = 0; tt < MT; ++tt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col0 = 4 * g + c, col1 = 32 + 4 * g + c;
      const int tok = 8 * tt + 2 * t;
      mine[tok * kTileN + col0] = acc[tt][c][0];
      mine[(tok + 1) * kTileN + col0] = acc[tt][c][1];
      mine[tok * kTileN + col1] = acc[tt][c][2];
      mine[(tok + 1) * kTileN + col1] = acc[tt][c][3];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kPlane; i += kThreads) {
    float v = red[i];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v += red[w * kPlane + i];
    red[i] = v;
  }
  __syncthreads();
}

// The CTA that owns item i of `items` split over `ctas` (every CTA owns at least one item).
__device__ inline int owner(int64_t i, int64_t items, int ctas) {
  return static_cast<int>(((i + 1) * ctas - 1) / items);
}

template <typename T>
__device__ inline void write_out(const Params& p, int tile, int m, int col, float v) {
  const int n = tile * kTileN + col;
  if (p.bias != nullptr) v += Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[n]);
  static_cast<uint16_t*>(p.out)[static_cast<int64_t>(m) * p.N + n] = Dtype<T>::from_float(v);
}

// Write the CTA's sum for (tile, blocks [b0, b1)): directly when it owns the whole tile, else
// through the workspace, the last contributor reducing in CTA order.
template <typename T, int MT>
__device__ inline void flush(const Params& p, int tile, bool whole, const float* red,
                             int64_t items, int ctas) {
  const int valid = p.M * kTileN;  // red rows past M hold zeros
  if (whole) {
    for (int i = threadIdx.x; i < valid; i += kThreads) {
      const int m = i / kTileN, col = i % kTileN;
      if (tile * kTileN + col < p.N) write_out<T>(p, tile, m, col, red[i]);
    }
    return;
  }
  const int64_t slot_size = static_cast<int64_t>(p.M) * kTileN;
  float* slot = p.workspace + (tile + static_cast<int64_t>(blockIdx.x)) * slot_size;
  for (int i = threadIdx.x; i < valid; i += kThreads) slot[i] = red[i];
  __threadfence();
  __syncthreads();
  const int first = owner(static_cast<int64_t>(tile) * p.num_blocks, items, ctas);
  const int last = owner(static_cast<int64_t>(tile + 1) * p.num_blocks - 1, items, ctas);
  __shared__ int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(p.locks + tile, 1) == last - first;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < valid; i += kThreads) {
    const int m = i / kTileN, col = i % kTileN;
    float v = 0.0f;
    for (int c = first; c <= last; ++c) v += __ldcg(p.workspace + (tile + c) * slot_size + i);
    if (tile * kTileN + col < p.N) write_out<T>(p, tile, m, col, v);
  }
  if (threadIdx.x == 0) p.locks[tile] = 0;
}

// A CTA's run of blocks [b0, b1) in one column tile; this warp takes blocks b0 + warp + i kWarps.
struct Segment {
  int tile, b0, b1, count, warp;
  __device__ int block(int i) const { return b0 + warp + i * kWarps; }
};

__device__ inline Segment segment_at(const Params& p, int64_t item, int64_t end, int warp) {
  Segment s;
  s.tile = static_cast<int>(item / p.num_blocks);
  s.b0 = static_cast<int>(item % p.num_blocks);
  const int64_t left = end - item;
  s.b1 = left < p.num_blocks - s.b0 ? s.b0 + static_cast<int>(left) : p.num_blocks;
  s.count = s.b1 - s.b0 > warp ? (s.b1 - s.b0 - warp + kWarps - 1) / kWarps : 0;
  s.warp = warp;
  return s;
}

// Dynamic shared memory of one CTA: each warp's ring of STAGES slots, then the reduction tile.
template <int TOK, bool PQ, int STAGES>
constexpr size_t smem_bytes() {
  return sizeof(Slot<TOK, PQ>) * STAGES * kWarps +
         sizeof(float) * kWarps * 8 * Slot<TOK, PQ>::kMT * kTileN;
}

template <typename T, int TOK, bool PQ, int STAGES>
__global__ void __launch_bounds__(kThreads) gptq_stream_kernel(const Params p) {
  constexpr int MT = Slot<TOK, PQ>::kMT;
  static_assert(STAGES >= 2, "the ring needs a slot to fill while another is read");
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32;
  Slot<TOK, PQ>* ring = reinterpret_cast<Slot<TOK, PQ>*>(smem) + warp * STAGES;
  float* red = reinterpret_cast<float*>(smem + sizeof(Slot<TOK, PQ>) * STAGES * kWarps);
  pdl_launch_dependents();

  const int ctas = gridDim.x;
  const int64_t items = static_cast<int64_t>(p.tiles) * p.num_blocks;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * items / ctas;
  const int64_t end = static_cast<int64_t>(blockIdx.x + 1) * items / ctas;
  const bool has_zeros = p.zeros != nullptr;

  if (threadIdx.x % 32 == 0) {
    for (int i = 0; i < STAGES; ++i) mbar_init(&ring[i].bar);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  uint32_t issued = 0, consumed = 0;  // this warp's stages so far (ring slot = count % STAGES)

  // --- the first segment's weights go out before the wait for the previous kernel
  Segment seg = segment_at(p, begin, end, warp);
  int64_t item = begin + (seg.b1 - seg.b0);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < seg.count) issue_slot<TOK, PQ>(p, seg.tile, seg.block(i), ring[i], true, false);
  }
  pdl_wait();  // x is the previous kernel's output; out, workspace and locks may be its inputs
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < seg.count) {
      issue_slot<TOK, PQ>(p, seg.tile, seg.block(i), ring[i], false, true);
      ++issued;
    }
    cp_async_commit();
  }

  while (true) {
    float acc[MT][4][4] = {};
    for (int i = 0; i < seg.count; ++i) {
      cp_async_wait<STAGES - 2>();  // block i has landed (one group per block, empty ones too)
      Stage<MT, PQ> cur;
      read_slot<TOK, PQ>(p, ring[consumed % STAGES], (consumed / STAGES) & 1, cur);
      ++consumed;
      const int ahead = i + STAGES - 1;  // refill the slot read in the previous iteration
      if (ahead < seg.count && p.mode != 2) {
        issue_slot<TOK, PQ>(p, seg.tile, seg.block(ahead), ring[issued % STAGES], true, true);
        ++issued;
      }
      cp_async_commit();
      if (p.mode == 1 || p.mode == 3) {
        acc[0][0][0] += __int_as_float(cur.words[0][0].x ^ cur.words[3][1].w ^ cur.x[0][0].x ^ cur.scale[0][0].x);
      } else {
        compute<T, MT, PQ>(cur, has_zeros, acc);
      }
    }
    // --- start the next segment's loads (the ring is drained), then flush this one
    const Segment done = seg;
    const bool more = item < end;
    if (more) {
      seg = segment_at(p, item, end, warp);
      item += seg.b1 - seg.b0;
#pragma unroll
      for (int i = 0; i < STAGES - 1; ++i) {
        if (i < seg.count) {
          issue_slot<TOK, PQ>(p, seg.tile, seg.block(i), ring[issued % STAGES], true, true);
          ++issued;
        }
        cp_async_commit();
      }
    }
    if (p.mode == 3) {
      if (threadIdx.x == 0 && acc[0][0][0] == 1.2345f) p.locks[0] = 1;
    } else {
      reduce_warps<MT>(acc, red);
      flush<T, MT>(p, done.tile, done.b0 == 0 && done.b1 == p.num_blocks, red, items, ctas);
      __syncthreads();  // red is reused by the next segment
    }
    if (!more) break;
  }
  cp_async_wait<0>();
}

}  // namespace stream
}  // namespace pagedq
