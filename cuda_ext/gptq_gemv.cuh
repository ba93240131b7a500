// GPTQ 4-bit matmul for small batches (M <= 16): tensor cores, weights streamed once, stream-K.
//
// out[m, n] = sum_k x[m, k] * (q[k, n] - z'[g, n]) * s[g, n] (+ bias[n]), fp32 accumulation.
//
// Layout (pagedq/ops/gptq.py, PackedGPTQWeight): qweight [Kp/8, N] int32, Kp = 128 * ceil(K/128),
// input rows sorted by group; block b = word rows 16b..16b+15 holds input rows 128b..128b+127, and
// nibble p + 4h (bits 4p + 16h ..) of word row 16b + r is input row 128b + 32p + 2r + h. scales /
// zeros are [G, N] in T; zeros hold z' as exact integers (nullptr: every z' is 8).
//
// Work split. Items are (column tile of kTileN = 64 columns, 128-row block), in tile-major order,
// cut into runs of one block per K-slice (a tile's last run may be shorter; a slice is a warp, or
// a pair of warps from 9 tokens on: see Pairs). The grid is persistent (one CTA per resident
// slot) and CTA c owns runs [c * runs / C, (c + 1) * runs / C), a contiguous item range: every SM
// streams about the same bytes whatever the layer's shape ("stream-K"), and a CTA's segments are
// whole runs, so its slices get equal block counts except in a tile's last run (see Split). A
// CTA walks its range one tile segment at a time; slice s of S takes the segment's blocks s,
// s + S, ... through its own ring of shared-memory slots filled by cp.async, keeping kStages - 1
// blocks in flight while it computes one. Each lane reads back only what it copied, so the ring
// needs cp.async waits and no barriers (but a pair's). The next segment's first loads are issued
// before the current segment's partial sums are flushed.
//
// Warp tile. Lane (g, t) = (lane / 4, lane % 4) copies word rows 4t + j (j = 0..3) of columns
// 4g..4g+3 and 32+4g..32+4g+3 (16 bytes each: a warp copy is 4 rows x 2 x 128 bytes). mma
// m16n8k16 takes the weights as A: the 16 rows of n-tile c = 0..3 are columns {4g + c, 32 + 4g +
// c} (in a pair, see Pairs, {4g + 2c, 4g + 2c + 1} of the warp's half). mma (p, jj) takes nibble
// pair p of word rows 4t + 2jj and 4t + 2jj + 1 as A's k pairs (2t, 2t + 8), i.e. input rows
// 32p + 8t + 4jj + (0, 1) and (2, 3). B (activations, 8 tokens per n8 tile) is then words 2jj and
// 2jj + 1 of x[token][32p + 8t .. + 7], two adjacent registers of one 16-byte copy per (p, token
// tile) per block. One mma per weight word and token tile.
//
// Dequantization. ((word >> 4p) & 0x000F000F) | MAGIC read as a T pair is (MAGIC + q, MAGIC + q')
// exactly (fp16 MAGIC 1024, bf16 128); subtracting MAGIC + z' is exact. In fp16 the odd pairs
// skip the shift: (bits & 0x00F000F0) | MAGIC is 1024 + 16q, and one HFMA2 (x / 16 - (64 + z'))
// gives q - z' exactly; bf16 cannot (bit 7 is an exponent bit). With one group per block the
// mma runs on those exact integers and the fp32 block sums are scaled once; with 32- or 64-row
// groups the pairs are scaled in T first (one rounding, as in the reference). The loop was bound
// by instruction issue at small M (H200: a third fewer instructions per block cut the M=1 stack
// by 16%), hence zero points as a template parameter (no per-column selects) and copy addresses
// advanced by pointer increments (Feed). One token skips the dequantization: its mma is int8,
// on the raw nibbles and on the activations as integers (see "sliced" below).
//
// Split tiles. A tile shared by CTAs first..last is the last segment of CTA first and the first
// (or only) segment of the others, so a CTA writes at most one partial tile: the others store
// their partial sums to workspace slot `cta` as they finish the segment, and move on. CTA first
// keeps its own sums in shared memory and, at its end, reads the slots of first + 1..last in CTA
// order (results do not depend on timing), each value as soon as it is no longer kEmpty, and
// writes kEmpty back: the workspace is all kEmpty between launches. The values are their own
// signal: no counter, fence or acquire-release handshake (on the H200 the handshake's two round
// trips cost the M=1 stack 7%). CTA first waits only for higher-numbered CTAs of the same grid;
// all of them have started before any kernel that depends on this one can take their place
// (PDL), and the grid fits on the GPU at once. Launches that share a workspace run one at a
// time (one stream). A launch that faults mid-way leaves the CUDA context unusable, so no later
// launch sees a half-used workspace.
//
// Pairs (9..16 tokens). A slot then holds 16 tokens' activations, as many bytes as its weights,
// and a warp taking the whole 64-column tile needed 222 registers: 2 CTAs per SM. Instead the two
// warps of a pair share a slice and its ring: warp h copies and computes columns 32h..32h+31 (the
// 4 columns of each lane's 16-byte words in its half) and copies token tile h's activations; both
// read all of them, after a named barrier per block (each warp's cp.async waits cover its own
// copies only). A warp holds half the weights (158 registers) and a CTA two rings, so 3 CTAs fit
// per SM (12 warps). Runs are then 2 blocks, one per slice; grids below the resident slots (o and
// down are capped at 4 CTAs per tile) get padded shared memory so that they spread over all SMs
// instead of filling some with 3 (host: spread_smem). H200 stacks in one process, M=16: 1.496 ms
// without pairs, 1.480 with them, 1.585 without the padding (o 7.2 µs and down 14.0 against 6.3
// and 11.5).
//
// PDL (programmatic dependent launch, sm_90+): each CTA lets the next kernel launch at once and
// copies its first weights before waiting for the previous kernel; x, out and the workspace are
// only touched after the wait.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedq {
namespace gptq {

constexpr int kBlockK = 128;  // input rows per packed block
constexpr int kTileN = 64;    // output columns per tile (one warp, or a pair, covers them)
constexpr int kWarps = 4;     // warps per CTA
constexpr int kThreads = kWarps * 32;
// The grid has at most max_sharers CTAs per column tile, so about as many share a tile: the
// owner of a split tile waits for contributors whose whole range lies inside it (H200, M = 1 / 4
// / 8 / 16 stacks: 5 per tile 1.183 / 1.319 / 1.552 / 2.159 ms, 4 per tile 1.186 / 1.274 / 1.499
// / 2.062, no cap 1.230 / 1.320 / 1.552 / 2.155). One exception: a single token with more than
// 32 blocks (down, K = 11008) takes 5, 8.9 µs against 9.7 (M=1 stack 1.160 vs 1.180); 6 or 8 gave
// 9.2-9.3, and at M = 4..16 down lost with 5 (M=16: 16.3 vs 14.9 µs; gptq_w4a_2026-11-30s).
constexpr int kMaxSharers = 4;
__host__ __device__ inline int max_sharers(int m, int num_blocks) {
  return m == 1 && num_blocks > 32 ? kMaxSharers + 1 : kMaxSharers;
}
// K-slices of a CTA: slice s takes blocks s, s + slices, ... of each segment. Up to 8 tokens each
// warp is a slice of its own and covers all 64 columns of the tile. From 9 tokens two warps make
// a slice ("pairs", see Pairs) and share its ring.
__host__ __device__ constexpr int slices_for(int m) { return m > 8 ? 2 : kWarps; }
template <int TOK>
__host__ __device__ constexpr bool paired() {
  return slices_for(TOK) < kWarps;
}
// Ring slots per slice: 3 up to 8 tokens (H200: 4 was no faster and fits 2 CTAs/SM, not 3). At 16
// tokens a slot holds twice the activations, and one warp per slot left room for 2 slots at 2 CTAs
// per SM (3 slots: one CTA per SM, M=16 stack 3.11 ms against 2.49). A pair's 3 slots fit 3 CTAs
// per SM (H200 stacks in one process, bench/ab_gemv.py: M=16 2 slots 1.641 ms, 3 1.480, 4 (2 CTAs
// per SM) 1.539; gptq_w4a_2026-12-01j_notes.md).
constexpr int kStages = 3;

template <typename T>
struct Dtype;

template <>
struct Dtype<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagicBits = 0x64006400u;  // (1024, 1024)
  static constexpr bool kHighNibbles = true;  // (bits & 0x00F000F0) | MAGIC is 1024 + 16 q exactly
  __device__ static float to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  __device__ static uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Dtype<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagicBits = 0x43004300u;  // (128, 128)
  static constexpr bool kHighNibbles = false;  // bits 4..7 include an exponent bit
  __device__ static float to_float(uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  __device__ static uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Pair arithmetic on raw 32-bit registers holding two T values.
template <typename T>
__device__ inline typename Dtype<T>::T2 as_pair(uint32_t bits) {
  return *reinterpret_cast<const typename Dtype<T>::T2*>(&bits);
}
template <typename T>
__device__ inline uint32_t as_bits(typename Dtype<T>::T2 pair) {
  return *reinterpret_cast<const uint32_t*>(&pair);
}
template <typename T>
__device__ inline uint32_t add2(uint32_t a, uint32_t b) {
  return as_bits<T>(__hadd2(as_pair<T>(a), as_pair<T>(b)));
}
template <typename T>
__device__ inline uint32_t sub2(uint32_t a, uint32_t b) {
  return as_bits<T>(__hsub2(as_pair<T>(a), as_pair<T>(b)));
}
template <typename T>
__device__ inline uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  return as_bits<T>(__hfma2(as_pair<T>(a), as_pair<T>(b), as_pair<T>(c)));
}
template <typename T>
__device__ inline uint32_t mul2(uint32_t a, uint32_t b) {
  return as_bits<T>(__hmul2(as_pair<T>(a), as_pair<T>(b)));
}

struct Params {
  const void* x;           // [M, K] T, row stride x_stride elements (16-byte aligned rows)
  const int32_t* qweight;  // [Kp/8, N]
  const void* scales;      // [G, N] T
  const void* zeros;       // [G, N] T (z'), or nullptr: every z' is 8
  const void* bias;        // [N] T or nullptr
  void* out;               // [M, N] T contiguous
  float* workspace;        // [>= ctas, M, kTileN] fp32 partial tiles, all kEmpty between launches
  int64_t x_stride;
  int M, N, K;             // K % 8 == 0, N % 8 == 0
  int group_size, num_groups;
  int tiles, num_blocks;   // ceil(N / kTileN), ceil(K / kBlockK)
};

// One block's operands for one lane, in registers: WH column halves (2, or the warp's own one
// in a pair).
template <int MT, bool PQ, int WH = 2>
struct Stage {
  static constexpr int kQ = PQ ? 4 : 1;  // scale rows per block: per 32-row quarter p, or one
  uint4 words[4][WH];   // [j][h]: word row 4t + j, columns 4g.. (h = 0) / 32 + 4g.. (h = 1)
  uint4 x[MT][4];       // [token tile][p]: x[8 tt + g][128 b + 32 p + 8 t .. + 7]
  uint2 scale[WH][kQ];  // [h][q]: the 4 columns' scales
  uint2 zero[WH][kQ];   // the 4 columns' z' (unused without zeros)
};

// One slice's ring slot for one block. Word row r sits at word_offset(r), so the 16-byte reads of
// the 8 lanes of a shared-memory phase hit distinct banks; x and params are lane-interleaved.
template <int TOK, bool PQ>
struct Slot {
  static constexpr int kMT = TOK > 8 ? 2 : 1;     // 8-token tiles
  static constexpr int kTPT = TOK < 8 ? TOK : 8;  // tokens per tile: lanes g < kTPT hold x
  static constexpr int kQ = Stage<kMT, PQ>::kQ;
  static constexpr int kWordBytes = 16 * 256 + 3 * 32 + 32;
  alignas(16) unsigned char words[kWordBytes];
  uint4 x[4 * kMT][4 * kTPT];  // lane g * 4 + t (g < kTPT)
  uint2 params[4 * kQ][32];    // scale[h][q] at 2 (h kQ + q), zero at 2 (h kQ + q) + 1
};

// Rows 4t + j of the 4 t lanes of one phase land 32 bytes apart mod 128 bytes.
__host__ __device__ inline int word_offset(int r) { return 256 * r + 32 * (r / 4); }

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async of kBytes (16 or 8) from src, zero-filled when !valid (src is not read then).
template <int kBytes>
__device__ inline void cp_async(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
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

// The two warps of pair `slice` (0 or 1) meet at named barrier 1 + slice (barrier 0 is
// __syncthreads); constant ids, so that ptxas reserves only those.
__device__ inline void pair_sync(int slice) {
  if (slice == 0) {
    asm volatile("bar.sync 1, 64;" ::: "memory");
  } else {
    asm volatile("bar.sync 2, 64;" ::: "memory");
  }
}

__device__ inline void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ inline void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Group row of quarter q of block b (q = 0 for block-wide groups), clamped for padded rows.
// P: any launch parameters with group_size and num_groups (this kernel's and gptq_gemm.cuh's).
template <typename P>
__host__ __device__ inline int64_t group_row(const P& p, int b, int q) {
  const int row = b * kBlockK + 32 * q, gs = p.group_size;
  // power-of-two groups (all real checkpoints): a shift instead of an integer division
#ifdef __CUDA_ARCH__
  const int grp = (gs & (gs - 1)) == 0 ? row >> (__ffs(gs) - 1) : row / gs;
#else
  const int grp = row / gs;
#endif
  return grp < p.num_groups - 1 ? grp : p.num_groups - 1;
}

// This lane's source addresses for its warp's next block b (blocks advance by kStep, the CTA's
// slices).
template <int kStep>
struct Feed {
  const int32_t* w;   // word row 16b + 4t of column tile * 64 + 4g
  const uint16_t* x;  // x[g < M ? g : 0][128b + 8t]
  int b, col;         // block, column tile * 64 + 4g

  __device__ static Feed at(const Params& p, int tile, int b) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    Feed f;
    f.b = b;
    f.col = tile * kTileN + 4 * g;
    f.w = p.qweight + (static_cast<int64_t>(b) * 16 + 4 * t) * p.N + f.col;
    f.x = static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(g < p.M ? g : 0) * p.x_stride +
          b * kBlockK + 8 * t;
    return f;
  }
  __device__ void advance(const Params& p) {
    b += kStep;
    w += static_cast<int64_t>(kStep) * 16 * p.N;
    x += kStep * kBlockK;
  }
};

// Copy this lane's share of block f.b into `slot`: weights, scales and zeros (Z) of column
// halves `half`.. (all of them but in a pair), and/or x of token tiles `half`.. (likewise).
template <int TOK, bool PQ, bool Z>
__device__ inline void issue_slot(const Params& p, const Feed<slices_for(TOK)>& f,
                                  Slot<TOK, PQ>& slot,
                                  bool with_weights, bool with_x, int half) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr int kHalves = paired<TOK>() ? 1 : 2;
  constexpr int kTiles = paired<TOK>() ? 1 : Slot<TOK, PQ>::kMT;
  if (with_weights) {
    const int64_t n = p.N;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) {
      const int h = half + hh;
      const bool ok = f.col + 32 * h < p.N;  // N % 8 == 0: the 4 columns exist together
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        cp_async<16>(slot.words + word_offset(4 * t + j) + 16 * g + 128 * h,
                     f.w + j * n + 32 * h, ok);
      }
    }
#pragma unroll
    for (int q = 0; q < Slot<TOK, PQ>::kQ; ++q) {
      const int64_t at = group_row(p, f.b, q) * n + f.col;
#pragma unroll
      for (int hh = 0; hh < kHalves; ++hh) {
        const int h = half + hh;
        const bool ok = f.col + 32 * h < p.N;
        const int e = 2 * (h * Slot<TOK, PQ>::kQ + q);
        cp_async<8>(&slot.params[e][lane], static_cast<const uint16_t*>(p.scales) + at + 32 * h,
                    ok);
        if constexpr (Z) {
          cp_async<8>(&slot.params[e + 1][lane],
                      static_cast<const uint16_t*>(p.zeros) + at + 32 * h, ok);
        }
      }
    }
  }
  if (with_x && g < Slot<TOK, PQ>::kTPT) {
    const int k0 = f.b * kBlockK + 8 * t;
#pragma unroll
    for (int ti = 0; ti < kTiles; ++ti) {
      const int tt = half + ti;
      const int m = 8 * tt + g;
      const uint16_t* row = tt == 0 ? f.x : f.x + (m < p.M ? 8 * p.x_stride : 0);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const bool valid = m < p.M && k0 + 32 * q < p.K;  // K % 8 == 0: 8 rows exist together
        cp_async<16>(&slot.x[4 * tt + q][lane], row + 32 * q, valid);  // not read if !valid
      }
    }
  }
}

// The warp's column halves `half`.. (see issue_slot) and all token tiles of `slot`.
template <int TOK, bool PQ, bool Z, int WH>
__device__ inline void read_slot(const Params& p, const Slot<TOK, PQ>& slot,
                                 Stage<Slot<TOK, PQ>::kMT, PQ, WH>& s, int half) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int hh = 0; hh < WH; ++hh) {
      s.words[j][hh] = *reinterpret_cast<const uint4*>(slot.words + word_offset(4 * t + j) +
                                                       16 * g + 128 * (half + hh));
    }
  }
#pragma unroll
  for (int tt = 0; tt < Slot<TOK, PQ>::kMT; ++tt) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      s.x[tt][q] = g < Slot<TOK, PQ>::kTPT ? slot.x[4 * tt + q][lane] : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int hh = 0; hh < WH; ++hh) {
#pragma unroll
    for (int q = 0; q < Slot<TOK, PQ>::kQ; ++q) {
      const int e = 2 * ((half + hh) * Slot<TOK, PQ>::kQ + q);
      s.scale[hh][q] = slot.params[e][lane];
      s.zero[hh][q] = Z ? slot.params[e + 1][lane] : make_uint2(0, 0);
    }
  }
}

// (bits & 0x000F000F) | magic in one LOP3.
__device__ inline uint32_t nibble_pair(uint32_t bits, uint32_t magic) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "n"(0x000F000F), "r"(magic));
  return out;
}

// (bits & 0x00F000F0) | magic in one LOP3.
__device__ inline uint32_t nibble_pair_hi(uint32_t bits, uint32_t magic) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "n"(0x00F000F0), "r"(magic));
  return out;
}

__device__ inline uint32_t word_of(const uint4& v, int c) {
  return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w;
}

// Element c of 4 packed 16-bit values, in both halves (one PRMT).
__device__ inline uint32_t half_of(const uint2& v, int c) {
  return __byte_perm(c < 2 ? v.x : v.y, 0, c % 2 == 0 ? 0x1010 : 0x3232);
}

// Element c of 4 packed 16-bit values as a float (a converting move, no PRMT).
template <typename T>
__device__ inline float scale_of(const uint2& v, int c) {
  const auto pair = as_pair<T>(c < 2 ? v.x : v.y);
  return c % 2 == 0 ? __low2float(pair) : __high2float(pair);
}

// The n-tiles of a warp's columns: n-tile c's A rows g (r = 0) and g + 8 (r = 1) are column
// 4g + c + 32r with both halves (word c of half r), or 4g + 2c + r of the warp's half in a pair
// (word 2c + r of its one half).
template <int WH>
struct NTiles {
  static constexpr int kCount = 2 * WH;
  __device__ static constexpr int half(int r) { return WH == 2 ? r : 0; }
  __device__ static constexpr int word(int c, int r) { return WH == 2 ? c : 2 * c + r; }
};

// acc[tt][c] += this block's products (n-tile c, token tile tt).
template <typename T, int MT, bool PQ, bool has_zeros, int WH>
__device__ inline void compute(const Stage<MT, PQ, WH>& s,
                               float (&acc)[MT][NTiles<WH>::kCount][4]) {
  using NT = NTiles<WH>;
  constexpr uint32_t kMagic = Dtype<T>::kMagicBits;
  constexpr uint32_t kDefaultZero = kMagic + 0x00080008u;  // MAGIC + 8 in both halves, exact
#pragma unroll
  for (int c = 0; c < NT::kCount; ++c) {
    uint32_t zb[2][4], sc[2][4];  // [r][p]: MAGIC + z' and scale of A row g + 8r's column
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = NT::half(r), wi = NT::word(c, r);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int qi = PQ ? q : 0;
        if constexpr (PQ) sc[r][q] = half_of(s.scale[h][q], wi);
        // MAGIC + z' is exact: z' <= 16 lands on an integer step of MAGIC's binade
        if (Dtype<T>::kHighNibbles && q % 2 == 1) {
          // odd quarters: (MAGIC + 16 q) / 16 - (64 + z') = q - z' in one exact HFMA2
          zb[r][q] = has_zeros ? fma2<T>(half_of(s.zero[h][qi], wi), 0xBC00BC00u, 0xD400D400u)
                               : 0xD480D480u;  // -(64 + 8)
        } else {
          zb[r][q] = has_zeros ? add2<T>(kMagic, half_of(s.zero[h][qi], wi)) : kDefaultZero;
        }
      }
    }
    float part[MT][4] = {};  // block sums on exact integers (one group per block)
    // mma (q, jj): A's k pairs (2t, 2t + 8) are nibble pair q of word rows 4t + 2jj and
    // 4t + 2jj + 1, i.e. input rows 32q + 8t + 4jj + (0, 1) and (2, 3); B is then words 2jj and
    // 2jj + 1 of x[token][32q + 8t ..], adjacent registers of one 16-byte load.
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        uint32_t a[4];  // [j' * 2 + r]: rows 32q + 8t + 4jj + 2j' (+1) of A row g + 8r
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const uint32_t w = word_of(s.words[2 * jj + jp][NT::half(r)], NT::word(c, r));
            uint32_t d;
            if constexpr (Dtype<T>::kHighNibbles) {
              const uint32_t src = q >= 2 ? w >> 8 : w;
              d = q % 2 == 0 ? sub2<T>(nibble_pair(src, kMagic), zb[r][q])
                             : fma2<T>(nibble_pair_hi(src, kMagic), 0x2C002C00u, zb[r][q]);
            } else {
              d = sub2<T>(nibble_pair(w >> (4 * q), kMagic), zb[r][q]);
            }
            if constexpr (PQ) d = mul2<T>(d, sc[r][q]);
            a[2 * jp + r] = d;
          }
        }
#pragma unroll
        for (int tt = 0; tt < MT; ++tt) {
          Dtype<T>::mma(PQ ? acc[tt][c] : part[tt], a, word_of(s.x[tt][q], 2 * jj),
                        word_of(s.x[tt][q], 2 * jj + 1));
        }
      }
    }
    if constexpr (!PQ) {
      const float s0 = scale_of<T>(s.scale[NT::half(0)][0], NT::word(c, 0));  // A row g
      const float s1 = scale_of<T>(s.scale[NT::half(1)][0], NT::word(c, 1));  // A row g + 8
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

// --- One token: int8 tensor cores on the activations' bytes ("sliced").
//
// At one token, 7 of the 8 columns of every m16n8k16's B operand are padding, and the mma count
// (one per 256 weights) bounded the loop: removing the mmas cut the H200's M=1 stack by 0.16 ms.
// The int8 mma m16n8k32 takes 512 weights per instruction, and its 8 B columns can carry one
// token's activations as the bytes of integers:
// - Each block's 128 activations become y = round(x * 2^e), with one power of two per block
//   chosen from its largest |x| so that |y| < 2^22. Every x within 11 binades of the largest is
//   exact in fp16 (14 in bf16); smaller ones are rounded to within 2^-22 of the largest.
// - One FFMA adds 1.5 * 2^23: the float's low 23 bits are then u = y + 2^22, and its bytes 0..2
//   are B columns 0..2. Column 3 is all ones, so the mma also returns sum(q), and sum(q y) =
//   D0 + 2^8 D1 + 2^16 (D2 - 2^6 D3) in exact integers.
// - A is the weights' nibbles as bytes, straight from the packed words: w & 0x0F0F0F0F (q) and
//   w & 0xF0F0F0F0 (16 q, summed apart). No dequantization.
// - A group's float sum is (sum(q y) - z' sum(y)) * scale * 2^-e: exact integers inside a group,
//   one scaling per group, as with the fp16 mma.
// - With groups smaller than a block (PQ: a scale per 32-row quarter), each B byte's quarter is
//   fixed by the packing (see slice_x): columns 0..3 take the bytes of quarters 0 and 1, columns
//   4..7 those of quarters 2 and 3, each nibble half summed apart, and the same 16 mma per block
//   give every quarter its own sums.
// The warp converts a block's activations together (4 per lane) into B planes in its reduction
// plane (unused during the loop), then each lane loads its B fragments: 16 mma per block instead
// of 32, and one LOP3 per 4 weights. H200, M=1 stacks: g128 1.12 -> 1.06-1.08 ms, g64 1.41 ->
// 1.23. Two tokens on columns 4..7 were no faster (M=2 runs 2 CTAs per SM: 1.140 -> 1.131 ms),
// so M >= 2 keeps the fp16 mma.

// The float exponent of a block's largest |x| sets e: fp16 / bf16 exponent field E of |x| bits.
template <typename T>
struct SliceExp;
template <>
struct SliceExp<__half> {
  static constexpr int kShift = 10, kTop = 36, kInf = 31;  // |x| < 2^(E - 14): e = 36 - E
};
template <>
struct SliceExp<__nv_bfloat16> {
  static constexpr int kShift = 7, kTop = 148, kInf = 255;  // |x| < 2^(E - 126): e = 148 - E
};

// d += A B, int8 m16n8k32 (unsigned A and B, exact int32 sums).
__device__ inline void imma(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                            uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One block's activations for the sliced mma: this lane's B fragments and the factors of its D
// columns 2t, 2t + 1.
struct SlicedX {
  uint32_t b[2][4];  // [nibble half][a]: B of word row 4t + a, low (0) / high (1) nibbles
  float unscale;     // 2^-e, times 2^16 on odd t (see compute_sliced), / 16 without quarters
  float zsum[2];     // sum(y) of the low / high nibbles' rows (see compute_sliced); odd t: 0
};

// The B planes: 16-byte chunk Q(t, s, h) holds slice s (byte s of u) of word rows 4t..4t+3,
// nibble half h, one word per row; the XOR spreads the 8 lanes of a 16-byte read phase (slices
// s, s + 1 of t = 0..3) and the 32 lanes of a 4-byte store (one slice) over distinct banks.
__device__ inline int plane_chunk(int t, int s, int h) { return 8 * s + ((2 * t + h) ^ (s & 1)); }
constexpr int kPlaneChunks = 8 * 3;  // slices 0..2; the ones column is not stored

// Lane (r, h) = (lane / 2, lane % 2) converts input rows 32h + 2r + (0, 1) (quarter h) and 64 +
// 32h + 2r + (0, 1) (quarter 2 + h) of the block: the k order of word row r's nibbles 2i (h = 0)
// or 2i + 1 (h = 1) as bytes (rows 32h + 2r, 64 + 32h + 2r, 32h + 2r + 1, 64 + 32h + 2r + 1).
// Bytes 0 and 2 of every B word are then rows of quarters 0 (low nibbles) and 1 (high), bytes 1
// and 3 rows of quarters 2 and 3. With per-quarter scales (PQ), B columns 0..3 keep bytes 0, 2
// and columns 4..7 bytes 1, 3: each column holds one quarter of each nibble half.
template <typename T, bool PQ>
__device__ inline SlicedX slice_x(const uint32_t* xw, uint32_t* plane) {
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, h = lane % 2;
  // every lane's copies of x have landed (cp.async waits are per lane), and the previous block's
  // B fragments have been read
  __syncwarp();
  const uint32_t v01 = xw[16 * h + r], v23 = xw[32 + 16 * h + r];  // rows (0, 1), (64, 65) + ..
  uint32_t m = __vmaxu2(v01 & 0x7FFF7FFFu, v23 & 0x7FFF7FFFu);  // |x| bits order as |x|
  m = __reduce_max_sync(0xFFFFFFFFu, max(m & 0xFFFFu, m >> 16));
  const int top = static_cast<int>(m >> SliceExp<T>::kShift);
  const int e = min(SliceExp<T>::kTop - max(top, 1), 110);  // 2^e and 2^-e stay normal floats
  const float up = __int_as_float((127 + e) << 23);
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: low 23 bits of (kMagic + y) are y + 2^22
  const uint32_t f0 = __float_as_uint(__fmaf_rn(Dtype<T>::to_float(v01 & 0xFFFFu), up, kMagic));
  const uint32_t f1 = __float_as_uint(__fmaf_rn(Dtype<T>::to_float(v23 & 0xFFFFu), up, kMagic));
  const uint32_t f2 = __float_as_uint(__fmaf_rn(Dtype<T>::to_float(v01 >> 16), up, kMagic));
  const uint32_t f3 = __float_as_uint(__fmaf_rn(Dtype<T>::to_float(v23 >> 16), up, kMagic));
  const uint32_t lo01 = __byte_perm(f0, f1, 0x5140), lo23 = __byte_perm(f2, f3, 0x5140);
  const uint32_t slice[3] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                             __byte_perm(__byte_perm(f0, f1, 0x0062), __byte_perm(f2, f3, 0x0062),
                                         0x5410)};
  // sum(u) over rows (< 2^30), then sum(y) = sum(u) - rows * 2^22: the block's, or per quarter
  const uint32_t near = f0 + f2 - 2u * 0x4B000000u, far = f1 + f3 - 2u * 0x4B000000u;
  int sum_y[4];  // [quarter]; without quarters [0] is the block's
  if constexpr (PQ) {
    sum_y[0] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, h == 0 ? near : 0u)) - (1 << 27);
    sum_y[1] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, h == 1 ? near : 0u)) - (1 << 27);
    sum_y[2] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, h == 0 ? far : 0u)) - (1 << 27);
    sum_y[3] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, h == 1 ? far : 0u)) - (1 << 27);
  } else {
    sum_y[0] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, near + far)) - (1 << 29);
  }

#pragma unroll
  for (int s = 0; s < 3; ++s) plane[4 * plane_chunk(r / 4, s, h) + r % 4] = slice[s];
  __syncwarp();
  const int g = lane / 4, t = lane % 4;
  // B column g: slice g % 4 (g % 4 == 3: ones) under a byte mask; without quarters columns 4..7
  // are zero
  const uint32_t mask = PQ ? (g < 4 ? 0x00FF00FFu : 0xFF00FF00u) : (g < 4 ? 0xFFFFFFFFu : 0u);
  SlicedX out;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    uint4 v = make_uint4(0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u);
    if (g % 4 < 3) v = *reinterpret_cast<const uint4*>(plane + 4 * plane_chunk(t, g % 4, hh));
    out.b[hh][0] = v.x & mask;
    out.b[hh][1] = v.y & mask;
    out.b[hh][2] = v.z & mask;
    out.b[hh][3] = v.w & mask;
  }
  // even t holds columns 2t, 2t + 1 = slices 0, 1: D0 + 2^8 D1; odd t slice 2 and the ones:
  // 2^16 (D2 - 2^6 D3); without quarters the sums are 16 times the integers
  const int shift = (t % 2 == 1 ? 16 : 0) - (PQ ? 0 : 4);
  out.unscale = top == SliceExp<T>::kInf ? __int_as_float(0x7FC00000)
                                         : __int_as_float((127 - e + shift) << 23);
  const bool sums = t % 2 == 0 && (PQ || t == 0);
  if constexpr (PQ) {
    out.zsum[0] = sums ? static_cast<float>(t < 2 ? sum_y[0] : sum_y[2]) : 0.0f;
    out.zsum[1] = sums ? static_cast<float>(t < 2 ? sum_y[1] : sum_y[3]) : 0.0f;
  } else {
    out.zsum[0] = sums ? 16.0f * static_cast<float>(sum_y[0]) : 0.0f;
    out.zsum[1] = 0.0f;
  }
  return out;
}

// acc[0][c][2h] (lanes t = 0..3; added across them at the segment's end, fold_sliced) += this
// block's part of column 4g + c + 32h. Without quarters, lanes t = 0, 1 hold the whole block;
// with them, t = 0, 1 quarters 0 (low nibbles) and 1 (high), t = 2, 3 quarters 2 and 3.
template <typename T, bool PQ, bool has_zeros>
__device__ inline void compute_sliced(const Stage<1, PQ>& s, const SlicedX& x,
                                      float (&acc)[1][4][4]) {
  const int t = threadIdx.x % 4;
  const int coef = t % 2 == 0 ? 256 : -64;
  uint2 sc[2][2], zr[2][2];  // [h][nibble half]: the scales and z' of this lane's quarters
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int q0 = PQ ? n : 0, q2 = PQ ? 2 + n : 0;  // constant indices: registers
      sc[hh][n] = t < 2 ? s.scale[hh][q0] : s.scale[hh][q2];
      zr[hh][n] = t < 2 ? s.zero[hh][q0] : s.zero[hh][q2];
    }
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};  // q and 16 q parts
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // word rows 4t + 2u, 4t + 2u + 1
      const uint32_t w00 = word_of(s.words[2 * u][0], c), w01 = word_of(s.words[2 * u][1], c);
      const uint32_t w10 = word_of(s.words[2 * u + 1][0], c);
      const uint32_t w11 = word_of(s.words[2 * u + 1][1], c);
      imma(lo, w00 & 0x0F0F0F0Fu, w01 & 0x0F0F0F0Fu, w10 & 0x0F0F0F0Fu, w11 & 0x0F0F0F0Fu,
           x.b[0][2 * u], x.b[0][2 * u + 1]);
      imma(hi, w00 & 0xF0F0F0F0u, w01 & 0xF0F0F0F0u, w10 & 0xF0F0F0F0u, w11 & 0xF0F0F0F0u,
           x.b[1][2 * u], x.b[1][2 * u + 1]);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float z0 = has_zeros ? scale_of<T>(zr[hh][0], c) : 8.0f;
      if constexpr (PQ) {  // each nibble half its own quarter: scaled apart
        const int v_lo = lo[2 * hh] + coef * lo[2 * hh + 1];
        const int v_hi = (hi[2 * hh] + coef * hi[2 * hh + 1]) / 16;  // exact
        const float z1 = has_zeros ? scale_of<T>(zr[hh][1], c) : 8.0f;
        const float f = (static_cast<float>(v_lo) - z0 * x.zsum[0]) * scale_of<T>(sc[hh][0], c) +
                        (static_cast<float>(v_hi) - z1 * x.zsum[1]) * scale_of<T>(sc[hh][1], c);
        acc[0][c][2 * hh] = __fmaf_rn(f, x.unscale, acc[0][c][2 * hh]);
      } else {  // 16 sum(q u) over this lane's two columns, exact: < 2^31
        const int v = 16 * lo[2 * hh] + hi[2 * hh] + coef * (16 * lo[2 * hh + 1] + hi[2 * hh + 1]);
        const float f = (static_cast<float>(v) - z0 * x.zsum[0]) * x.unscale;
        acc[0][c][2 * hh] = __fmaf_rn(f, scale_of<T>(sc[hh][0], c), acc[0][c][2 * hh]);
      }
    }
  }
}

// Add each column's parts across lanes t = 0..3 (two of them without quarters): lane t = 0 is
// token row 0.
template <bool PQ>
__device__ inline void fold_sliced(float (&acc)[1][4][4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      acc[0][c][e] += __shfl_xor_sync(0xFFFFFFFFu, acc[0][c][e], 1);
      if constexpr (PQ) acc[0][c][e] += __shfl_xor_sync(0xFFFFFFFFu, acc[0][c][e], 2);
    }
  }
}

// The reduction planes in shared memory: a plane per slice of 8 * MT token rows of kTileN values,
// rows kRedStride floats apart so that the 16-byte stores of a phase (8 lanes, rows 2t + r,
// columns 4g..) hit distinct banks. The end phase moves 16-byte units of 4 columns: unit u of a
// tile is row u / kUnitsPerRow, columns 4 (u % kUnitsPerRow) ..; thread threadIdx.x takes units
// threadIdx.x + j * kThreads in reduce_warps, flush and finish alike, so it only ever reads
// back units it summed itself.
constexpr int kRedStride = kTileN + 4;
constexpr int kUnitsPerRow = kTileN / 4;
__device__ inline float* unit_at(float* red, int u) {
  return red + u / kUnitsPerRow * kRedStride + u % kUnitsPerRow * 4;
}

// Sum the slices' accumulators of the first M token rows into plane 0 of red (plane s: slice
// s; the warps of a pair fill its two column halves). No barrier after the sums: see kRedStride.
template <int MT, int WH, int kSlices>
__device__ inline void reduce_warps(const Params& p, const float (&acc)[MT][2 * WH][4],
                                    float* red, int slice, int half) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr int kPlane = 8 * MT * kRedStride;
  float* mine = red + slice * kPlane;
#pragma unroll
  for (int tt = 0; tt < MT; ++tt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 8 * tt + 2 * t + e % 2;
      if constexpr (WH == 2) {
        // acc[tt][c][e] is token 8 tt + 2t + e % 2, column 32 (e / 2) + 4g + c
        *reinterpret_cast<float4*>(mine + row * kRedStride + 32 * (e / 2) + 4 * g) =
            make_float4(acc[tt][0][e], acc[tt][1][e], acc[tt][2][e], acc[tt][3][e]);
      } else if (e < 2) {
        // acc[tt][c][e] is token 8 tt + 2t + e % 2, column 32 half + 4g + 2c + e / 2
        *reinterpret_cast<float4*>(mine + row * kRedStride + 32 * half + 4 * g) =
            make_float4(acc[tt][0][e], acc[tt][0][e + 2], acc[tt][1][e], acc[tt][1][e + 2]);
      }
    }
  }
  __syncthreads();
  for (int u = threadIdx.x; u < p.M * kUnitsPerRow; u += kThreads) {
    float4* sum = reinterpret_cast<float4*>(unit_at(red, u));
    float4 v = *sum;
#pragma unroll
    for (int w = 1; w < kSlices; ++w) {
      const float4 o = sum[w * kPlane / 4];
      v.x += o.x;
      v.y += o.y;
      v.z += o.z;
      v.w += o.w;
    }
    *sum = v;
  }
}

// The stream-K split: items (column tile, 128-row block) in tile-major order, cut into runs of
// `run` blocks (a tile's last run may be shorter); CTA c of `ctas` (<= runs) takes runs
// [c * runs / ctas, (c + 1) * runs / ctas). The GEMV's runs are kWarps blocks: split at single
// blocks, a CTA's segments had up to a block more for some warps than for others, and the CTA
// waits for its slowest warp at every segment's end (H200 stacks, bench runs v -> w of
// 2026-11-30: M=16 1.558 -> 1.478 ms, M=12 1.510 -> 1.431, M=1 1.151 -> 1.119, M=8 1.232 both).
// The wgmma GEMM's runs are single blocks (one consumer pair takes all of a block).
struct Split {
  int64_t runs;
  int per_tile, run, num_blocks, ctas;
  __host__ __device__ Split(int tiles, int num_blocks_, int run_, int ctas_)
      : runs(static_cast<int64_t>(tiles) * ((num_blocks_ + run_ - 1) / run_)),
        per_tile((num_blocks_ + run_ - 1) / run_),
        run(run_),
        num_blocks(num_blocks_),
        ctas(ctas_) {}
  __host__ __device__ int64_t item(int64_t r) const {  // the first item of run r
    return r / per_tile * num_blocks + r % per_tile * run;
  }
  __host__ __device__ int64_t begin(int c) const { return item(c * runs / ctas); }
  __host__ __device__ int64_t end(int c) const { return begin(c + 1); }
  __host__ __device__ int owner(int64_t r) const {  // the CTA taking run r
    return static_cast<int>(((r + 1) * ctas - 1) / runs);
  }
  // The CTAs sharing tile `tile`: first..last (owners of its first and last runs).
  __host__ __device__ void contributors(int tile, int& first, int& last) const {
    first = owner(static_cast<int64_t>(tile) * per_tile);
    last = owner(static_cast<int64_t>(tile + 1) * per_tile - 1);
  }
};

// The GEMV's split of `p` over `ctas` CTAs (the host sizes the grid from its runs): runs of
// slices_for(p.M) blocks, one per slice (a constant in the kernel).
__host__ __device__ inline Split gemv_split(const Params& p, int ctas, int slices) {
  return Split(p.tiles, p.num_blocks, slices, ctas);
}

// out[m, n..n+3] = v (+ bias), n = tile * kTileN + col (N % 8 == 0: the 4 columns exist
// together), as one 8-byte store.
template <typename T>
__device__ inline void write_out4(const Params& p, int tile, int m, int col, const float* v) {
  const int n = tile * kTileN + col;
  uint32_t half[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float f = v[e];
    if (p.bias != nullptr) f += Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[n + e]);
    half[e] = Dtype<T>::from_float(f);
  }
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + static_cast<int64_t>(m) * p.N + n) =
      make_uint2(half[0] | half[1] << 16, half[2] | half[3] << 16);
}

// An unwritten workspace value: a NaN that no arithmetic returns (the GPU's NaN is 0x7FFFFFFF).
constexpr uint32_t kEmpty = 0xFFFFFFFFu;

// finish: a thread's units of a tile, and the contributors whose slots it reads in one round
// trip: all its units of each, about kReadsInFlight 16-byte reads at once. Rounds used to go
// value by value, each a round trip, 8 of them at 16 tokens (H200 stacks, M = 1 / 8 / 16: 1.191 /
// 1.503 / 2.077 ms; by contributor, 4 values in flight: 1.183 / 1.370 / 1.774; 8 or 16: no faster;
// in 16-byte units, 8 in flight tied 4: gptq_w4a_2026-11-30v_notes.md).
constexpr int kReadsInFlight = 4;
template <int TOK>
__host__ __device__ constexpr int units_per_thread() {
  return (TOK * kUnitsPerRow + kThreads - 1) / kThreads;
}
template <int TOK>
__host__ __device__ constexpr int slots_per_round() {
  return units_per_thread<TOK>() >= kReadsInFlight ? 1 : kReadsInFlight / units_per_thread<TOK>();
}

// Workspace values are read while other CTAs write them: relaxed GPU-scope accesses, 16 bytes
// at a time; each 32-bit value lands on its own (no ordering between values is needed).
__device__ inline void store_slot4(float* at, float a, float b, float c, float d) {
  asm volatile("st.relaxed.gpu.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(at), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}
__device__ inline uint4 load_slot4(const float* at) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(at)
               : "memory");
  return v;
}
__device__ inline bool any_empty(const uint4& v) {
  return v.x == kEmpty || v.y == kEmpty || v.z == kEmpty || v.w == kEmpty;
}

// Write the CTA's sums `red` for `tile`: to out when it owns the whole tile, else to its
// workspace slot ([M][kTileN] fp32; CTA first keeps them in red instead, see finish).
template <typename T>
__device__ inline void flush(const Params& p, int tile, bool whole, float* red) {
  float* slot = p.workspace + static_cast<int64_t>(blockIdx.x) * p.M * kTileN;
  for (int u = threadIdx.x; u < p.M * kUnitsPerRow; u += kThreads) {
    const float* v = unit_at(red, u);
    if (!whole) {
      store_slot4(slot + 4 * u, v[0], v[1], v[2], v[3]);
    } else if (tile * kTileN + u % kUnitsPerRow * 4 < p.N) {
      write_out4<T>(p, tile, u / kUnitsPerRow, u % kUnitsPerRow * 4, v);
    }
  }
}

// Once the CTA's range is done: for `owned` (its last segment, a tile it is the first of;
// -1: none), add the other contributors' slots to red in CTA order as their values arrive, empty
// the slots and write the sums to out. A round reads slots_per_round contributors, all of the
// thread's units of each, and re-reads a unit until none of its values is kEmpty. Polling all
// of a thread's values for all contributors at once, as the wgmma GEMM does, was slower (H200
// stack, M=1: 1.22-1.40 ms against 1.19; gptq_w4a_2026-11-30r).
template <typename T, int TOK>
__device__ inline void finish(const Params& p, int owned, float* red, const Split& split) {
  if (owned < 0) return;
  constexpr int kPer = units_per_thread<TOK>(), kRound = slots_per_round<TOK>();
  int first, last;
  split.contributors(owned, first, last);
  const int units = p.M * kUnitsPerRow;
  const int64_t slot_floats = static_cast<int64_t>(units) * 4;
  for (int c0 = first + 1; c0 <= last; c0 += kRound) {  // fixed CTA order: deterministic
    uint4 bits[kRound][kPer];  // one round trip for all of them
#pragma unroll
    for (int c = 0; c < kRound; ++c) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int u = threadIdx.x + j * kThreads;
        if (c0 + c <= last && u < units) {
          bits[c][j] = load_slot4(p.workspace + (c0 + c) * slot_floats + 4 * u);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kRound; ++c) {
      if (c0 + c > last) break;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int u = threadIdx.x + j * kThreads;
        if (u < units) {
          float* at = p.workspace + (c0 + c) * slot_floats + 4 * u;
          while (any_empty(bits[c][j])) bits[c][j] = load_slot4(at);  // values land one by one
          float* sum = unit_at(red, u);  // a unit the thread summed itself
          sum[0] += __uint_as_float(bits[c][j].x);
          sum[1] += __uint_as_float(bits[c][j].y);
          sum[2] += __uint_as_float(bits[c][j].z);
          sum[3] += __uint_as_float(bits[c][j].w);
          const float empty = __uint_as_float(kEmpty);
          store_slot4(at, empty, empty, empty, empty);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int u = threadIdx.x + j * kThreads;
    if (u < units && owned * kTileN + u % kUnitsPerRow * 4 < p.N) {
      write_out4<T>(p, owned, u / kUnitsPerRow, u % kUnitsPerRow * 4, unit_at(red, u));
    }
  }
}

// A CTA's run of blocks [b0, b1) in one column tile; slice s of kSlices takes blocks
// b0 + s + i kSlices.
template <int kSlices = kWarps>
struct Segment {
  int tile, b0, b1, count, slice;
  __host__ __device__ int block(int i) const { return b0 + slice + i * kSlices; }
};

template <int kSlices = kWarps>
__host__ __device__ inline Segment<kSlices> segment_at(const Params& p, int64_t item, int64_t end,
                                                        int slice) {
  Segment<kSlices> s;
  s.tile = static_cast<int>(item / p.num_blocks);
  s.b0 = static_cast<int>(item % p.num_blocks);
  const int64_t left = end - item;
  s.b1 = left < p.num_blocks - s.b0 ? s.b0 + static_cast<int>(left) : p.num_blocks;
  s.count = s.b1 - s.b0 > slice ? (s.b1 - s.b0 - slice + kSlices - 1) / kSlices : 0;
  s.slice = slice;
  return s;
}

// Dynamic shared memory of one CTA: each slice's ring, then the reduction planes.
template <int TOK, bool PQ>
constexpr size_t smem_bytes() {
  constexpr int kSlices = slices_for(TOK);
  return sizeof(Slot<TOK, PQ>) * kStages * kSlices +
         sizeof(float) * kSlices * 8 * Slot<TOK, PQ>::kMT * kRedStride;
}
// One token with block-wide groups (M=1 decode of g128 / g-1 checkpoints) fits 3 CTAs per SM on
// the H200: 228 KB of shared memory per SM, 1 KB of it reserved per CTA. A few more bytes per CTA
// would leave 2 (a third fewer weights in flight), and the ring depth and the sharer cap were
// tuned at 3.
static_assert(3 * (smem_bytes<1, false>() + 1024) <= 228 * 1024, "M=1 no longer fits 3 CTAs/SM");
static_assert(16 * kPlaneChunks <= sizeof(float) * 8 * kRedStride, "B planes exceed a warp's plane");
// Pairs with block-wide groups fit 3 CTAs per SM too (see Pairs); with a scale per quarter
// (32/64-row groups) their larger parameter slots leave 2 (one before the pairs).
static_assert(3 * (smem_bytes<16, false>() + 1024) <= 228 * 1024, "pairs no longer fit 3 CTAs/SM");

// The kernel for one zero-point mode (Z: zeros given).
template <typename T, int TOK, bool PQ, bool Z>
__device__ inline void gemv_body(const Params& p) {
  constexpr int MT = Slot<TOK, PQ>::kMT;
  constexpr bool kSliced = TOK == 1;  // the int8 path (see "sliced")
  constexpr int kSlices = slices_for(TOK);
  constexpr int kWH = paired<TOK>() ? 1 : 2;  // column halves a warp holds
  // No static __shared__ variables: they are laid out ahead of this array. A 16-byte one cost the
  // M = 8 / 16 stacks 14% (H200: 1.403 vs 1.227 ms, 1.703 vs 1.482; gptq_w4a_2026-11-30x_notes).
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32;
  const int slice = warp / (kWarps / kSlices);  // and `half`: the warp's place in its pair
  const int half = paired<TOK>() ? warp % 2 : 0;
  Slot<TOK, PQ>* ring = reinterpret_cast<Slot<TOK, PQ>*>(smem) + slice * kStages;
  float* red = reinterpret_cast<float*>(smem + sizeof(Slot<TOK, PQ>) * kStages * kSlices);
  pdl_launch_dependents();

  const Split split = gemv_split(p, gridDim.x, kSlices);
  const int64_t begin = split.begin(blockIdx.x), end = split.end(blockIdx.x);
  int owned = -1;  // the split tile this CTA finishes (see finish)

  // --- the first segment's weights go out before waiting for the previous kernel
  Segment<kSlices> seg = segment_at<kSlices>(p, begin, end, slice);
  int64_t item = begin + (seg.b1 - seg.b0);
  Feed<kSlices> feed = Feed<kSlices>::at(p, seg.tile, seg.block(0));
  {
    Feed<kSlices> f = feed;
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < seg.count) issue_slot<TOK, PQ, Z>(p, f, ring[i], true, false, half);
      f.advance(p);
    }
  }
  pdl_wait();  // x is the previous kernel's output; out and the workspace may be its inputs
  int fill = 0, read = 0;  // ring slots of the next copy and the next read
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < seg.count) {
      issue_slot<TOK, PQ, Z>(p, feed, ring[i], false, true, half);
      fill = i + 1;
    }
    feed.advance(p);
    cp_async_commit();  // one group per ring step, empty ones too: the waits count groups
  }

  while (true) {
    float acc[MT][2 * kWH][4] = {};
    for (int i = 0; i < seg.count; ++i) {
      cp_async_wait<kStages - 2>();  // block i has landed
      // a pair: the partner's copies of block i have landed too, and it has read block i - 1
      if constexpr (paired<TOK>()) pair_sync(slice);
      Stage<MT, PQ, kWH> cur;
      read_slot<TOK, PQ, Z, kWH>(p, ring[read], cur, half);
      const Slot<TOK, PQ>& now = ring[read];
      read = read + 1 == kStages ? 0 : read + 1;
      if (i + kStages - 1 < seg.count) {  // refill the slot read in the previous step
        issue_slot<TOK, PQ, Z>(p, feed, ring[fill], true, true, half);
        feed.advance(p);
        fill = fill + 1 == kStages ? 0 : fill + 1;
      }
      cp_async_commit();
      if constexpr (kSliced) {
        // this warp's reduction plane is free until the segment's end
        const SlicedX sx = slice_x<T, PQ>(
            reinterpret_cast<const uint32_t*>(now.x),
            reinterpret_cast<uint32_t*>(red + warp * 8 * MT * kRedStride));
        compute_sliced<T, PQ, Z>(cur, sx, acc);
      } else {
        compute<T, MT, PQ, Z, kWH>(cur, acc);
      }
    }
    if constexpr (kSliced) fold_sliced<PQ>(acc);
    // --- start the next segment's copies (the ring is drained), then flush this one
    const Segment<kSlices> done = seg;
    const bool more = item < end;
    if (more) {
      seg = segment_at<kSlices>(p, item, end, slice);
      item += seg.b1 - seg.b0;
      feed = Feed<kSlices>::at(p, seg.tile, seg.block(0));
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) {
        if (i < seg.count) {
          issue_slot<TOK, PQ, Z>(p, feed, ring[fill], true, true, half);
          feed.advance(p);
          fill = fill + 1 == kStages ? 0 : fill + 1;
        }
        cp_async_commit();
      }
    }
    reduce_warps<MT, kWH, kSlices>(p, acc, red, slice, half);
    const bool whole = done.b0 == 0 && done.b1 == p.num_blocks;
    if (!whole && done.b0 == 0) {
      owned = done.tile;  // the CTA is the tile's first contributor: red stays for finish
    } else {
      flush<T>(p, done.tile, whole, red);
    }
    __syncthreads();  // red is reused by the next segment
    if (!more) break;
  }
  cp_async_wait<0>();
  finish<T, TOK>(p, owned, red, split);
}

template <typename T, int TOK, bool PQ>
__global__ void __launch_bounds__(kThreads) gptq_gemv_kernel(const Params p) {
  // one branch per launch; both bodies share the kernel's registers and shared memory
  if (p.zeros != nullptr) {
    gemv_body<T, TOK, PQ, true>(p);
  } else {
    gemv_body<T, TOK, PQ, false>(p);
  }
}

}  // namespace gptq
}  // namespace pagedq
