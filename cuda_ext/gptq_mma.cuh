// GPTQ 4-bit matmul for small batches (M <= 16) on tensor cores (mma.sync m16n8k16).
//
// Same packed layout, parameters, grid and split-K fix-up as the GEMV in gptq_gemv.cuh; only the
// per-CTA work differs. A CTA owns kTileN = 32 output columns and one K split; each of its 4 warps
// streams a contiguous run of that split's 128-row blocks with no block-wide synchronisation until
// the final reduction, keeping kMmaDepth blocks (2 KB each) of loads in flight.
//
// Fragment mapping. Lane (g, t) = (lane / 4, lane % 4) loads, for r-quarter rr = 0..3 of a block,
// word row 4 rr + t of columns n0 + 4g .. n0 + 4g + 3 (one 16-byte load; 8 lanes g cover 128
// contiguous bytes). Column c of those four is column g of n-tile c, so n-tile c, column j is the
// physical column tile0 + 4 j + c. Pair p of a word holds rows (32p + 8rr + 2t, +1) of the block
// (see PackedGPTQWeight: word row r holds rows 32p + 2r + h); k-step (rr, u) takes pairs 2u and
// 2u + 1 as the B registers b0, b1, i.e. logical rows (2t, 2t+1) and (2t+8, 2t+9) are physical
// rows 64u + 8rr + 2t (+1) and 64u + 32 + 8rr + 2t (+1). The A registers read the same x pairs
// straight from global memory (L1/L2 hits: x is tiny): a0/a2 from row g, a1/a3 from row g + 8.
// The accumulator c0, c1 (c2, c3) of n-tile c is out[g (+8), tile0 + 4 (2t) + c] and
// out[g (+8), tile0 + 4 (2t + 1) + c].
#pragma once

#include "gptq_gemv.cuh"

namespace pagedq {
namespace gptq {

constexpr int kMmaDepth = 4;    // blocks of weight loads in flight per warp
constexpr int kMmaMinCtas = 2;  // resident CTAs per SM the register budget must allow

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__half> {
  __device__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaOp<__nv_bfloat16> {
  __device__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// The weight side of one warp's share of one block, as loaded: 4 word rows of 4 columns and the
// group parameters (raw, 4 values of T each) of its NQ row quarters (1: one group per block,
// 4: one group per 32 or 64 rows).
template <int NQ>
struct WeightLoad {
  uint4 words[4];   // word row 4 rr + t, columns n0 .. n0 + 3
  uint2 scale[NQ];  // quarter q: scales of columns n0 .. n0 + 3
  uint2 zero[NQ];   // quarter q: z' of columns n0 .. n0 + 3 (unused without zeros)
};

// The activation side: x pairs of rows g and g + 8 (rows past M and K read as 0).
template <int ROWS>
struct XLoad {
  uint32_t v[ROWS / 8][4][4];  // [row half][rr][pair p]: x rows 32p + 8rr + 2t (+1)
};

// Issue the weight loads of block b for this lane; !valid: weights and scales read as 0, so the
// lane adds nothing (block outside the warp's range, or columns past N).
template <typename T, int NQ>
__device__ inline void load_weights(const GemvParams<T>& p, int b, int n0, bool valid,
                                    WeightLoad<NQ>& out) {
  const int t = threadIdx.x % 4;
  const int32_t* wp = p.qweight + static_cast<int64_t>(b) * kWordRows * p.N + n0;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    out.words[rr] = valid ? load_words(wp + static_cast<int64_t>(4 * rr + t) * p.N)
                          : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    out.scale[q] = make_uint2(0u, 0u);
    out.zero[q] = make_uint2(0u, 0u);
    if (!valid) continue;
    int grp = (b * kBlockK + q * 32) / p.group_size;
    grp = grp < p.num_groups - 1 ? grp : p.num_groups - 1;  // rows past K clamp (their x is 0)
    const int64_t at = static_cast<int64_t>(grp) * p.N + n0;
    out.scale[q] = __ldg(reinterpret_cast<const uint2*>(p.scales + at));
    if (p.zeros != nullptr) out.zero[q] = __ldg(reinterpret_cast<const uint2*>(p.zeros + at));
  }
}

template <typename T>
__device__ inline uint32_t load_x_pair(const GemvParams<T>& p, int row, int k) {
  if (row >= p.M || k >= p.K) return 0u;  // K is even: k < K means both rows of the pair exist
  const T* ptr = p.x + static_cast<int64_t>(row) * p.x_stride + k;
  return __ldg(reinterpret_cast<const unsigned int*>(ptr));
}

template <typename T, int ROWS>
__device__ inline void load_x(const GemvParams<T>& p, int b, bool valid, XLoad<ROWS>& out) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < ROWS / 8; ++h) {
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        const int k = b * kBlockK + 32 * pp + 8 * rr + 2 * t;
        out.v[h][rr][pp] = valid ? load_x_pair<T>(p, g + 8 * h, k) : 0u;
      }
    }
  }
}

// Scale and MAGIC + z' pairs of column c, quarter q, from the raw loads.
template <typename T>
__device__ inline void group_pairs(const GemvParams<T>& p, const uint2& s_raw, const uint2& z_raw,
                                   int c, typename Pair<T>::T2& scale, typename Pair<T>::T2& zero) {
  T s[kCols], z[kCols];
  memcpy(s, &s_raw, sizeof(s));
  memcpy(z, &z_raw, sizeof(z));
  const float sf = Pair<T>::to_float(s[c]);
  const float zf = p.zeros != nullptr ? Pair<T>::to_float(z[c]) : 8.0f;
  scale = Pair<T>::make(sf, sf);
  zero = Pair<T>::make(Pair<T>::kMagic + zf, Pair<T>::kMagic + zf);
}

// acc[c] += x rows x dequantized block, for the 4 n-tiles c of this lane's columns.
template <typename T, int ROWS, int NQ>
__device__ inline void mma_block(const GemvParams<T>& p, const WeightLoad<NQ>& in,
                                 const XLoad<ROWS>& x, float (&acc)[kCols][4]) {
  using T2 = typename Pair<T>::T2;
  T2 scale[kCols][NQ], zero[kCols][NQ];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) group_pairs<T>(p, in.scale[q], in.zero[q], c, scale[c][q], zero[c][q]);
  }
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const uint32_t cols[kCols] = {in.words[rr].x, in.words[rr].y, in.words[rr].z, in.words[rr].w};
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      T2 s4[4], z4[4];  // pair p of the word lies in quarter p
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        s4[q] = scale[c][NQ == 1 ? 0 : q];
        z4[q] = zero[c][NQ == 1 ? 0 : q];
      }
      T2 w[4];
      dequant_word<T>(cols[c], s4, z4, w);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint32_t a[4] = {x.v[0][rr][2 * u], ROWS > 8 ? x.v[ROWS / 16][rr][2 * u] : 0u,
                               x.v[0][rr][2 * u + 1],
                               ROWS > 8 ? x.v[ROWS / 16][rr][2 * u + 1] : 0u};
        uint32_t b0, b1;
        memcpy(&b0, &w[2 * u], sizeof(b0));
        memcpy(&b1, &w[2 * u + 1], sizeof(b1));
        MmaOp<T>::run(acc[c], a, b0, b1);
      }
    }
  }
}

// The warp's accumulators into partial[warp][m * kTileN + col] (ROWS x kTileN floats each).
template <int ROWS>
__device__ inline void store_fragments(const float (&acc)[kCols][4], float* partial) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float* mine = partial + warp * ROWS * kTileN;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    mine[g * kTileN + 8 * t + c] = acc[c][0];
    mine[g * kTileN + 8 * t + 4 + c] = acc[c][1];
    if (ROWS > 8) {
      mine[(g + 8) * kTileN + 8 * t + c] = acc[c][2];
      mine[(g + 8) * kTileN + 8 * t + 4 + c] = acc[c][3];
    }
  }
}

// NQ: 1 when every 128-row block lies in one group, 4 when groups are 32 or 64 rows.
template <typename T, int ROWS, int NQ>
__global__ void __launch_bounds__(kThreads, kMmaMinCtas) gptq_mma_kernel(const GemvParams<T> p) {
  static_assert(ROWS == 8 || ROWS == 16, "one m16 tile, rows 8..15 optional");
  __shared__ __align__(16) float partial[kWarps * ROWS * kTileN];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kTileN + (lane / 4) * kCols;
  const bool cols_ok = n0 < p.N;  // N % 8 == 0: all 4 columns exist or none
  const int num_blocks = (p.K + kBlockK - 1) / kBlockK;
  const int cta_begin = blockIdx.y * p.blocks_per_split;
  const int cta_end = min(cta_begin + p.blocks_per_split, num_blocks);
  const int per_warp = (p.blocks_per_split + kWarps - 1) / kWarps;
  const int begin = cta_begin + warp * per_warp;
  const int end = min(begin + per_warp, cta_end);

  // weights kMmaDepth blocks ahead (reloaded once consumed), x one block ahead
  float acc[kCols][4] = {};
  WeightLoad<NQ> wbuf[kMmaDepth];
#pragma unroll
  for (int i = 0; i < kMmaDepth; ++i) {
    load_weights<T, NQ>(p, begin + i, n0, begin + i < end && cols_ok, wbuf[i]);
  }
  XLoad<ROWS> x_cur;
  load_x<T, ROWS>(p, begin, begin < end, x_cur);
  for (int b = begin; b < end; b += kMmaDepth) {
#pragma unroll
    for (int i = 0; i < kMmaDepth; ++i) {
      if (b + i >= end) break;
      XLoad<ROWS> x_next;
      load_x<T, ROWS>(p, b + i + 1, b + i + 1 < end, x_next);
      mma_block<T, ROWS, NQ>(p, wbuf[i], x_cur, acc);
      const int ahead = b + i + kMmaDepth;
      load_weights<T, NQ>(p, ahead, n0, ahead < end && cols_ok, wbuf[i]);
      x_cur = x_next;
    }
  }

  store_fragments<ROWS>(acc, partial);
  __syncthreads();
  for (int i = threadIdx.x; i < ROWS * kTileN; i += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += partial[w * ROWS * kTileN + i];
    partial[i] = v;  // only this thread touches index i of every warp's tile
  }
  __syncthreads();
  write_tile<T, ROWS>(p, partial);
}

}  // namespace gptq
}  // namespace pagedq
