// GPTQ 4-bit matmul for small batches (M <= 16) on tensor cores (mma.sync m16n8k16).
//
// Same packed layout, parameters, grid and split-K fix-up as the GEMV in gptq_gemv.cuh; only the
// per-CTA work differs. A CTA owns kTileN = 32 output columns and one K split; it stages the
// split's activations in shared memory once (staged order, see staged_index), then each of its 4
// warps streams a contiguous run of the split's 128-row blocks, kMmaDepth blocks (2 KB each) of
// weight loads in flight, with no block-wide synchronisation until the final reduction.
//
// Fragment mapping. Lane (g, t) = (lane / 4, lane % 4) loads, for r-quarter rr = 0..3 of a block,
// word row 4 rr + t of columns n0 + 4g .. n0 + 4g + 3 (one 16-byte load; 8 lanes g cover 128
// contiguous bytes). Column c of those four is column g of n-tile c, so n-tile c, column j is the
// physical column tile0 + 4 j + c. Pair p of a word holds rows (32p + 8rr + 2t, +1) of the block
// (see PackedGPTQWeight: word row r holds rows 32p + 2r + h); k-step (rr, u) takes pairs 2u and
// 2u + 1 as the B registers b0, b1, i.e. logical rows (2t, 2t+1) and (2t+8, 2t+9) are physical
// rows 64u + 8rr + 2t (+1) and 64u + 32 + 8rr + 2t (+1). The A registers are the same x pairs:
// one 16-byte shared-memory read per (row, rr) in staged order; a0/a2 from row g, a1/a3 from
// row g + 8 (ROWS = 1: only row 0, in lanes g = 0). The accumulator c0, c1 (c2, c3) of n-tile c
// is out[g (+8), tile0 + 8t + c] and out[g (+8), tile0 + 8t + 4 + c].
//
// Dequantisation, fp16: the low nibble pair of a byte pair is (MAGIC | q) = 1024 + q exactly, the
// high one (MAGIC | q << 4) = 1024 + 16 q; q - z' is then one exact sub or fma (by 1/16), so a
// word costs one shift, 4 LOP3 and 4 pair ops. bf16 (7 mantissa bits) shifts each pair down.
// With one group per block (NQ = 1) the tensor cores see the exact integers q - z' and the
// per-column scale multiplies the block's fp32 sums; with 32- or 64-row groups (NQ = 4) the
// scale is applied to the weights before the mma.
#pragma once

#include <type_traits>

#include "gptq_gemv.cuh"

namespace pagedq {
namespace gptq {

constexpr int kMmaDepth = 4;    // blocks of weight loads in flight per warp
constexpr int kMmaMinCtas = 2;  // resident CTAs per SM the register budget must allow
constexpr int kMmaMaxSmem = 100 * 1024;  // staged activations per CTA (2 CTAs per SM fit)
constexpr int kMmaRowPad = 32;  // halves of padding per staged row (conflict-free 16-byte reads)

// Staged row stride (elements) for a split of `span` rows: span + pad, 16-byte aligned, so that
// two rows read by one quarter-warp land in different banks.
__host__ __device__ inline int mma_row_stride(int span) { return span + kMmaRowPad; }

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

// The weight side of one warp's share of one block, as loaded: 4 word rows of 4 columns, the
// z' of those columns and the scales of the accumulator columns (NQ = 1) or of the B columns
// per quarter (NQ = 4).
template <int NQ>
struct WeightLoad {
  uint4 words[4];  // word row 4 rr + t, columns n0 .. n0 + 3
  uint4 scale;     // NQ = 1: scales of columns tile0 + 8t .. + 7 (the accumulator columns)
  uint2 qscale[NQ == 4 ? 4 : 1];  // NQ = 4: quarter q's scales of columns n0 .. n0 + 3
  uint2 zero[NQ];  // quarter q: z' of columns n0 .. n0 + 3 (unused without zeros)
};

template <typename T>
__device__ inline int group_of(const GemvParams<T>& p, int row) {
  const int grp = row / p.group_size;
  return grp < p.num_groups - 1 ? grp : p.num_groups - 1;  // rows past K clamp (their x is 0)
}

// Issue the weight loads of block b for this lane; !valid: everything reads as 0, so the lane
// adds nothing (block outside the warp's range, or columns past N).
template <typename T, int NQ>
__device__ inline void load_weights(const GemvParams<T>& p, int b, int tile0, int n0, bool valid,
                                    WeightLoad<NQ>& out) {
  const int t = threadIdx.x % 4;
  const int32_t* wp = p.qweight + static_cast<int64_t>(b) * kWordRows * p.N + n0;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    out.words[rr] = valid ? load_words(wp + static_cast<int64_t>(4 * rr + t) * p.N)
                          : make_uint4(0u, 0u, 0u, 0u);
  }
  out.scale = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    out.zero[q] = make_uint2(0u, 0u);
    if (NQ == 4) out.qscale[q] = make_uint2(0u, 0u);
  }
  if (!valid) return;
  if (NQ == 1) {
    const int64_t at = static_cast<int64_t>(group_of(p, b * kBlockK)) * p.N + tile0 + 8 * t;
    if (tile0 + 8 * t < p.N) out.scale = __ldg(reinterpret_cast<const uint4*>(p.scales + at));
  }
#pragma unroll
  for (int q = 0; q < NQ; ++q) {
    const int64_t at = static_cast<int64_t>(group_of(p, b * kBlockK + q * 32)) * p.N + n0;
    if (NQ == 4) out.qscale[q] = __ldg(reinterpret_cast<const uint2*>(p.scales + at));
    if (p.zeros != nullptr) out.zero[q] = __ldg(reinterpret_cast<const uint2*>(p.zeros + at));
  }
}

// Copy x[0:ROWS, k_begin : k_begin + span] into shared memory in staged order (0 past M, K).
template <typename T, int ROWS>
__device__ inline void stage_rows(const GemvParams<T>& p, T* staged, int k_begin, int span) {
  const T zero = Pair<T>::from_float(0.0f);
  const int stride = mma_row_stride(span);
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    const T* row = p.x + m * p.x_stride + k_begin;
    const int valid = m < p.M ? min(span, p.K - k_begin) : 0;  // coalesced reads along K
    for (int kl = threadIdx.x; kl < span; kl += kThreads) {
      staged[m * stride + staged_index(kl)] = kl < valid ? row[kl] : zero;
    }
  }
}

// The q - z' (NQ = 1) or (q - z') * s (NQ = 4) pairs of one word; see the file comment.
template <typename T, int NQ>
__device__ inline void dequant_mma(uint32_t word, const typename Pair<T>::T2 (&zb)[4],
                                   const typename Pair<T>::T2 (&s)[4], typename Pair<T>::T2 (&w)[4]);

template <>
__device__ inline void dequant_mma<__half, 1>(uint32_t word, const __half2 (&zb)[4],
                                              const __half2 (&)[4], __half2 (&w)[4]) {
  // zb[p]: p even: (1024 + z', ..), p odd: (64 + z', ..); sixteenth = 1/16
  const __half2 sixteenth = __half2half2(__ushort_as_half(0x2c00u));
  const uint32_t hi = word >> 8;
  w[0] = __hsub2(bits_to_pair<__half2>(and_or<0x000F000Fu, 0x64006400u>(word)), zb[0]);
  w[1] = __hfma2(bits_to_pair<__half2>(and_or<0x00F000F0u, 0x64006400u>(word)), sixteenth,
                 __hneg2(zb[1]));
  w[2] = __hsub2(bits_to_pair<__half2>(and_or<0x000F000Fu, 0x64006400u>(hi)), zb[2]);
  w[3] = __hfma2(bits_to_pair<__half2>(and_or<0x00F000F0u, 0x64006400u>(hi)), sixteenth,
                 __hneg2(zb[3]));
}

template <>
__device__ inline void dequant_mma<__nv_bfloat16, 1>(uint32_t word, const __nv_bfloat162 (&zb)[4],
                                                     const __nv_bfloat162 (&)[4],
                                                     __nv_bfloat162 (&w)[4]) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t bits = and_or<0x000F000Fu, 0x43004300u>(word >> (4 * p));
    w[p] = __hsub2(bits_to_pair<__nv_bfloat162>(bits), zb[p]);
  }
}

template <>
__device__ inline void dequant_mma<__half, 4>(uint32_t word, const __half2 (&zb)[4],
                                              const __half2 (&s)[4], __half2 (&w)[4]) {
  const __half2 none[4] = {};
  dequant_mma<__half, 1>(word, zb, none, w);
#pragma unroll
  for (int p = 0; p < 4; ++p) w[p] = __hmul2(w[p], s[p]);
}

template <>
__device__ inline void dequant_mma<__nv_bfloat16, 4>(uint32_t word, const __nv_bfloat162 (&zb)[4],
                                                     const __nv_bfloat162 (&s)[4],
                                                     __nv_bfloat162 (&w)[4]) {
  const __nv_bfloat162 none[4] = {};
  dequant_mma<__nv_bfloat16, 1>(word, zb, none, w);
#pragma unroll
  for (int p = 0; p < 4; ++p) w[p] = __hmul2(w[p], s[p]);
}

// Zero-point pairs of column c, pair p, as dequant_mma wants them (fp16 odd p: 64 + z').
template <typename T, int NQ>
__device__ inline void zero_pairs(const GemvParams<T>& p, const WeightLoad<NQ>& in, int c,
                                  typename Pair<T>::T2 (&zb)[4]) {
#pragma unroll
  for (int pp = 0; pp < 4; ++pp) {
    T z[kCols];
    memcpy(z, &in.zero[NQ == 1 ? 0 : pp], sizeof(z));
    const float zf = p.zeros != nullptr ? Pair<T>::to_float(z[c]) : 8.0f;
    const bool sixteenths = std::is_same<T, __half>::value && pp % 2 == 1;
    const float v = (sixteenths ? 64.0f : Pair<T>::kMagic) + zf;
    zb[pp] = Pair<T>::make(v, v);
  }
}

// acc += x rows x dequantized block; x_s: this split's staged activations.
template <typename T, int ROWS, int NQ>
__device__ inline void mma_block(const GemvParams<T>& p, const WeightLoad<NQ>& in, const T* x_s,
                                 int stride, int b_local, float (&acc)[kCols][4]) {
  using T2 = typename Pair<T>::T2;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float part[kCols][4] = {};  // NQ = 1: this block's unscaled sums
  float(&sum)[kCols][4] = NQ == 1 ? part : acc;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    uint4 xa = make_uint4(0u, 0u, 0u, 0u), xb = make_uint4(0u, 0u, 0u, 0u);
    const T* xr = x_s + b_local * kBlockK + (4 * rr + t) * 8;
    if (ROWS > 1 || g == 0) xa = *reinterpret_cast<const uint4*>(xr + g * stride);
    if (ROWS > 8) xb = *reinterpret_cast<const uint4*>(xr + (g + 8) * stride);
    const uint32_t xa_w[4] = {xa.x, xa.y, xa.z, xa.w}, xb_w[4] = {xb.x, xb.y, xb.z, xb.w};
    const uint32_t cols[kCols] = {in.words[rr].x, in.words[rr].y, in.words[rr].z, in.words[rr].w};
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      T2 zb[4], s[4], w[4];
      zero_pairs<T, NQ>(p, in, c, zb);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        T sv[kCols];
        memcpy(sv, &in.qscale[NQ == 4 ? q : 0], sizeof(sv));
        s[q] = Pair<T>::make(Pair<T>::to_float(sv[c]), Pair<T>::to_float(sv[c]));
      }
      dequant_mma<T, NQ>(cols[c], zb, s, w);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint32_t a[4] = {xa_w[2 * u], xb_w[2 * u], xa_w[2 * u + 1], xb_w[2 * u + 1]};
        uint32_t b0, b1;
        memcpy(&b0, &w[2 * u], sizeof(b0));
        memcpy(&b1, &w[2 * u + 1], sizeof(b1));
        MmaOp<T>::run(sum[c], a, b0, b1);
      }
    }
  }
  if (NQ == 1) {  // acc += scale (of the accumulator's column) * block sums
    T sv[8];
    memcpy(sv, &in.scale, sizeof(sv));
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float s_lo = Pair<T>::to_float(sv[c]), s_hi = Pair<T>::to_float(sv[4 + c]);
      acc[c][0] += s_lo * part[c][0];
      acc[c][1] += s_hi * part[c][1];
      acc[c][2] += s_lo * part[c][2];
      acc[c][3] += s_hi * part[c][3];
    }
  }
}

// The warp's accumulators into partial[warp][m * kTileN + col] (ROWS_OUT x kTileN floats each).
template <int ROWS_OUT>
__device__ inline void store_fragments(const float (&acc)[kCols][4], float* partial) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float* mine = partial + warp * ROWS_OUT * kTileN;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (g < ROWS_OUT) {
      mine[g * kTileN + 8 * t + c] = acc[c][0];
      mine[g * kTileN + 8 * t + 4 + c] = acc[c][1];
    }
    if (ROWS_OUT > 8) {
      mine[(g + 8) * kTileN + 8 * t + c] = acc[c][2];
      mine[(g + 8) * kTileN + 8 * t + 4 + c] = acc[c][3];
    }
  }
}

// ROWS: x rows staged and multiplied (1, 8 or 16 >= M); NQ: 1 when every 128-row block lies in
// one group, 4 when groups are 32 or 64 rows. Dynamic smem: ROWS * mma_row_stride(span) T's.
template <typename T, int ROWS, int NQ>
__global__ void __launch_bounds__(kThreads, kMmaMinCtas) gptq_mma_kernel(const GemvParams<T> p) {
  static_assert(ROWS == 1 || ROWS == 8 || ROWS == 16, "x rows: 1, 8 or 16");
  extern __shared__ __align__(16) unsigned char smem[];
  T* x_s = reinterpret_cast<T*>(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile0 = blockIdx.x * kTileN;
  const int n0 = tile0 + (lane / 4) * kCols;
  const bool cols_ok = n0 < p.N;  // N % 8 == 0: all 4 columns exist or none
  const int num_blocks = (p.K + kBlockK - 1) / kBlockK;
  const int cta_begin = blockIdx.y * p.blocks_per_split;
  const int cta_end = min(cta_begin + p.blocks_per_split, num_blocks);
  const int span = max(cta_end - cta_begin, 0) * kBlockK;
  const int stride = mma_row_stride(span);
  const int per_warp = (p.blocks_per_split + kWarps - 1) / kWarps;
  const int begin = cta_begin + warp * per_warp;
  const int end = min(begin + per_warp, cta_end);

  // weights kMmaDepth blocks ahead (reloaded once consumed), activations staged once
  WeightLoad<NQ> wbuf[kMmaDepth];
#pragma unroll
  for (int i = 0; i < kMmaDepth; ++i) {
    load_weights<T, NQ>(p, begin + i, tile0, n0, begin + i < end && cols_ok, wbuf[i]);
  }
  stage_rows<T, ROWS>(p, x_s, cta_begin * kBlockK, span);
  __syncthreads();
  float acc[kCols][4] = {};
  for (int b = begin; b < end; b += kMmaDepth) {
#pragma unroll
    for (int i = 0; i < kMmaDepth; ++i) {
      if (b + i >= end) break;
      mma_block<T, ROWS, NQ>(p, wbuf[i], x_s, stride, b + i - cta_begin, acc);
      const int ahead = b + i + kMmaDepth;
      load_weights<T, NQ>(p, ahead, tile0, n0, ahead < end && cols_ok, wbuf[i]);
    }
  }
  __syncthreads();  // the staged activations are dead: reuse the smem for the reduction

  constexpr int kRowsOut = ROWS == 16 ? 16 : 8;
  float* partial = reinterpret_cast<float*>(smem);
  store_fragments<kRowsOut>(acc, partial);
  __syncthreads();
  for (int i = threadIdx.x; i < kRowsOut * kTileN; i += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += partial[w * kRowsOut * kTileN + i];
    partial[i] = v;  // only this thread touches index i of every warp's tile
  }
  __syncthreads();
  write_tile<T, kRowsOut>(p, partial);
}

// Dynamic shared memory of one CTA: the staged activations or the reduction, whichever is larger.
template <int ROWS>
inline size_t mma_smem_bytes(int blocks_per_split, int elem_size) {
  const size_t staged = static_cast<size_t>(ROWS) * mma_row_stride(blocks_per_split * kBlockK) *
                        elem_size;
  const size_t reduce = static_cast<size_t>(kWarps) * (ROWS == 16 ? 16 : 8) * kTileN * 4;
  return staged > reduce ? staged : reduce;
}

}  // namespace gptq
}  // namespace pagedq
