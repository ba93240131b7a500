// GPTQ 4-bit GEMV for small batches (M <= 16): templated raw-pointer kernel.
//
// out[m, n] = sum_k x[m, k] * (q[k, n] - z'[g, n]) * s[g, n] (+ bias[n]), fp32 accumulation.
//
// Layout (pagedq/ops/gptq.py, PackedGPTQWeight): qweight [Kp/8, N] int32, Kp = 128 * ceil(K/128),
// input rows sorted by group. Block b = word rows 16b..16b+15 holds input rows 128b..128b+127;
// nibble p + 4h (bits 4p + 16h ..) of word row 16b + r is input row 128b + 32p + 2r + h.
// scales / zeros are [G, N] in T; zeros hold z' as exact integers (nullptr: every z' is 8);
// group g covers sorted rows g * group_size .. (g + 1) * group_size - 1, group_size % 32 == 0
// (so both rows of a pair, and a whole 32-row quarter p, share one group).
//
// Work split: a CTA owns kTileN = 32 output columns and the 128-row blocks of one K split.
// Thread (tk, tn) = (threadIdx.x / 8, threadIdx.x % 8): tn picks 4 adjacent columns, read with
// one 16-byte load per word row; tk takes whole blocks b = begin + tk, begin + tk + 16, ...
// so one warp load covers 4 blocks x 128 contiguous bytes, and scales are read once per block.
// The split's activations are staged in shared memory once, permuted so that the 8 values one
// word multiplies are a single 16-byte read in the order the dequantization produces them.
//
// Dequantization in registers: ((word >> 4p) & 0x000F000F) | MAGIC read as a T pair is
// (MAGIC + q, MAGIC + q') of rows (32p + 2r, 32p + 2r + 1) exactly; subtracting (MAGIC + z') is
// exact and the scale multiply rounds once. The products of one or two words (kWordsPerSum) are
// summed in the pair type (at most 8 per lane), and those sums accumulate in fp32.
//
// Split-K: each CTA writes its fp32 partial tile to workspace[split]; the last CTA of a column
// tile to arrive (counter in locks) sums the partials in split order, adds the bias, writes T
// and resets its counter to 0, so locks is all zeros between launches.
//
// The helpers are __host__ __device__ where possible so cuda_ext/host_check.cu can run the
// per-thread arithmetic on the CPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace pagedq {
namespace gptq {

constexpr int kBlockK = 128;    // input rows per packed block
constexpr int kWordRows = 16;   // int32 word rows per block (8 nibbles each)
constexpr int kCols = 4;        // output columns per thread: one 16-byte load
constexpr int kThreadsN = 8;    // threads along N per CTA
constexpr int kThreadsK = 16;   // threads along K per CTA, each taking whole blocks
constexpr int kThreads = kThreadsN * kThreadsK;
constexpr int kWarps = kThreads / 32;
constexpr int kTileN = kThreadsN * kCols;     // output columns per CTA
constexpr int kRowChunk = 8;                  // word rows loaded before they are consumed
// words whose products are summed in T2 before an fp32 add: 2 saves conversions at small M,
// 1 keeps registers in check at large M
template <int M_TILE>
constexpr int kWordsPerSum = M_TILE <= 4 ? 2 : 1;
constexpr int kMaxStagedBytes = 48 * 1024;    // staged activations per CTA (no smem opt-in)

// T (__half or __nv_bfloat16) and its pair type, with the exponent trick's magic number.
template <typename T>
struct Pair;

template <>
struct Pair<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagicBits = 0x64006400u;  // (1024, 1024)
  static constexpr float kMagic = 1024.0f;
  __host__ __device__ static float to_float(__half v) { return __half2float(v); }
  __host__ __device__ static __half from_float(float v) { return __float2half_rn(v); }
  __host__ __device__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __host__ __device__ static __half2 make(float lo, float hi) { return __floats2half2_rn(lo, hi); }
};

template <>
struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagicBits = 0x43004300u;  // (128, 128)
  static constexpr float kMagic = 128.0f;
  __host__ __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __host__ __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
  __host__ __device__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __host__ __device__ static __nv_bfloat162 make(float lo, float hi) {
    return __floats2bfloat162_rn(lo, hi);
  }
};

template <typename T>
struct GemvParams {
  const T* x;              // [M, K], row stride x_stride, unit stride along K
  const int32_t* qweight;  // [Kp/8, N] block-interleaved nibbles
  const T* scales;         // [G, N]
  const T* zeros;          // [G, N] z', or nullptr: every z' is 8
  const T* bias;           // [N] or nullptr
  T* out;                  // [M, N] contiguous
  float* workspace;        // [split, M, N] fp32 when split > 1
  int32_t* locks;          // [>= ceil(N / kTileN)] arrival counters, zero between launches
  int64_t x_stride;
  int M, N, K;
  int group_size, num_groups;
  int blocks_per_split, split;
};

// Staged position of activation kl (counted from the split's first input row): the 8 values a
// word row multiplies are adjacent, pair p = rows (32p + 2r, 32p + 2r + 1) at slots 2p, 2p + 1.
__host__ __device__ inline int staged_index(int kl) {
  const int block = kl / kBlockK;
  const int in_block = kl % kBlockK;  // = 32 p + 2 r + h
  const int p = in_block / 32, r = (in_block % 32) / 2, h = in_block % 2;
  return block * kBlockK + r * 8 + 2 * p + h;
}

template <typename T2>
__host__ __device__ inline T2 bits_to_pair(uint32_t bits) {
  T2 v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

template <typename T2>
__host__ __device__ inline T2 fma2(T2 a, T2 b, T2 c) {
#ifdef __CUDA_ARCH__
  return __hfma2(a, b, c);
#else
  return __hadd2(__hmul2(a, b), c);  // host check only: one extra rounding
#endif
}

// (bits & mask) | magic in one LOP3 (plain C++ leaves two: one per immediate).
template <uint32_t kMask, uint32_t kMagic>
__host__ __device__ inline uint32_t and_or(uint32_t bits) {
#ifdef __CUDA_ARCH__
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(bits), "n"(kMask), "n"(kMagic));
  return out;
#else
  return (bits & kMask) | kMagic;
#endif
}

// The 8 weights of one word as 4 pairs: w[p] = ((q_p, q_{p+4}) - z') * s, exact up to the multiply.
template <typename T>
__host__ __device__ inline void dequant_word(uint32_t word, const typename Pair<T>::T2 (&scale)[4],
                                             const typename Pair<T>::T2 (&zero_biased)[4],
                                             typename Pair<T>::T2 (&w)[4]) {
  using T2 = typename Pair<T>::T2;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t bits = and_or<0x000F000Fu, Pair<T>::kMagicBits>(word >> (4 * p));
    w[p] = __hmul2(__hsub2(bits_to_pair<T2>(bits), zero_biased[p]), scale[p]);
  }
}

// sum += w_j * x_j over the 8 weights of one word, in T2 (4 products per lane).
template <typename T>
__host__ __device__ inline typename Pair<T>::T2 dot_word(const typename Pair<T>::T2 (&w)[4],
                                                         const typename Pair<T>::T2 (&x)[4],
                                                         typename Pair<T>::T2 sum) {
#pragma unroll
  for (int p = 0; p < 4; ++p) sum = fma2(w[p], x[p], sum);
  return sum;
}

// Both lanes of a T2 partial sum, added in fp32.
template <typename T>
__host__ __device__ inline float fold(typename Pair<T>::T2 sum) {
  const float2 f = Pair<T>::to_float2(sum);
  return f.x + f.y;
}

// Four adjacent values of T as floats (one 8-byte load on the device).
template <typename T>
__host__ __device__ inline void load_cols(const T* ptr, float (&v)[kCols]) {
  T t[kCols];
#ifdef __CUDA_ARCH__
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(ptr));
  memcpy(t, &raw, sizeof(raw));
#else
  memcpy(t, ptr, sizeof(t));
#endif
#pragma unroll
  for (int c = 0; c < kCols; ++c) v[c] = Pair<T>::to_float(t[c]);
}

// One word row of 4 columns (16 bytes, streamed: the weights are read once per call).
__host__ __device__ inline uint4 load_words(const int32_t* ptr) {
#ifdef __CUDA_ARCH__
  return __ldcs(reinterpret_cast<const uint4*>(ptr));
#else
  uint4 v;
  memcpy(&v, ptr, sizeof(v));
  return v;
#endif
}

// Ask L2 for a block's 16 word rows of 4 columns, so the fetch overlaps activation staging.
__device__ inline void prefetch_block(const int32_t* qweight, int b, int n, int n0) {
  const int32_t* wp = qweight + static_cast<int64_t>(b) * kWordRows * n + n0;
#pragma unroll
  for (int r = 0; r < kWordRows; ++r) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(wp + static_cast<int64_t>(r) * n));
  }
}

// Scale and MAGIC + z' of the 4 row quarters p of block b (rows 128b + 32p ..), columns n0..n0+3.
template <typename T>
__host__ __device__ inline void load_group_params(const GemvParams<T>& p, int b, int n0,
                                                  typename Pair<T>::T2 (&scale)[kCols][4],
                                                  typename Pair<T>::T2 (&zero)[kCols][4]) {
  const bool one_per_block = p.num_groups == 1 || p.group_size % kBlockK == 0;
  float s[4][kCols];
  float z[4][kCols];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (q > 0 && one_per_block) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        s[q][c] = s[0][c];
        z[q][c] = z[0][c];
      }
      continue;
    }
    int g = (b * kBlockK + q * 32) / p.group_size;
    g = g < p.num_groups - 1 ? g : p.num_groups - 1;  // rows past K clamp (their x is 0)
    const int64_t offset = static_cast<int64_t>(g) * p.N + n0;
    load_cols<T>(p.scales + offset, s[q]);
    if (p.zeros != nullptr) {
      load_cols<T>(p.zeros + offset, z[q]);
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) z[q][c] = 8.0f;
    }
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      scale[c][q] = Pair<T>::make(s[q][c], s[q][c]);
      zero[c][q] = Pair<T>::make(Pair<T>::kMagic + z[q][c], Pair<T>::kMagic + z[q][c]);
    }
  }
}

// acc[m][c] += sum over block b of x[m, k] * W^T[k, n0 + c]; staged = this split's activations.
template <typename T, int M_TILE>
__host__ __device__ inline void accumulate_block(const GemvParams<T>& p, const T* staged, int span,
                                                 int b, int b_local, int n0,
                                                 float (&acc)[M_TILE][kCols]) {
  using T2 = typename Pair<T>::T2;
  T2 scale[kCols][4];
  T2 zero[kCols][4];
  load_group_params<T>(p, b, n0, scale, zero);
  const int32_t* wp = p.qweight + static_cast<int64_t>(b) * kWordRows * p.N + n0;
  const T* xb = staged + b_local * kBlockK;
#pragma unroll
  for (int r0 = 0; r0 < kWordRows; r0 += kRowChunk) {
    uint4 words[kRowChunk];
#pragma unroll
    for (int r = 0; r < kRowChunk; ++r) {
      words[r] = load_words(wp + static_cast<int64_t>(r0 + r) * p.N);
    }
#pragma unroll
    for (int r = 0; r < kRowChunk; r += kWordsPerSum<M_TILE>) {
      T2 sums[M_TILE][kCols];  // products of kWordsPerSum words, summed in T2 per lane
#pragma unroll
      for (int i = 0; i < kWordsPerSum<M_TILE>; ++i) {
        const uint4 row = words[r + i];
        const uint32_t cols[kCols] = {row.x, row.y, row.z, row.w};
        T2 w[kCols][4];
#pragma unroll
        for (int c = 0; c < kCols; ++c) dequant_word<T>(cols[c], scale[c], zero[c], w[c]);
#pragma unroll
        for (int m = 0; m < M_TILE; ++m) {
          const uint4 raw = *reinterpret_cast<const uint4*>(xb + m * span + (r0 + r + i) * 8);
          T2 xv[4];
          memcpy(xv, &raw, sizeof(raw));
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            sums[m][c] = dot_word<T>(w[c], xv, i == 0 ? Pair<T>::make(0.0f, 0.0f) : sums[m][c]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < M_TILE; ++m) {
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[m][c] += fold<T>(sums[m][c]);
      }
    }
  }
}

// Copy x[0:M_TILE, k_begin : k_begin + span] into shared memory in staged order (0 past M, K).
template <typename T, int M_TILE>
__device__ inline void stage_activations(const GemvParams<T>& p, T* staged, int k_begin, int span) {
  const T zero = Pair<T>::from_float(0.0f);
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) {
    const T* row = p.x + m * p.x_stride + k_begin;
    const int valid = m < p.M ? min(span, p.K - k_begin) : 0;  // coalesced reads along K
    for (int kl = threadIdx.x; kl < span; kl += kThreads) {
      staged[m * span + staged_index(kl)] = kl < valid ? row[kl] : zero;
    }
  }
}

// Sum the threads' accumulators into partial[m * kTileN + col] (partial: kWarps tiles of smem).
template <int M_TILE>
__device__ inline void reduce_tile(float (&acc)[M_TILE][kCols], float* partial) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < M_TILE; ++m) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float v = acc[m][c];  // lanes tn, tn + 8, tn + 16, tn + 24 hold the same columns
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      acc[m][c] = v;
    }
  }
  if (lane < kThreadsN) {
    float* mine = partial + warp * M_TILE * kTileN;
#pragma unroll
    for (int m = 0; m < M_TILE; ++m) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) mine[m * kTileN + lane * kCols + c] = acc[m][c];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M_TILE * kTileN; i += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += partial[w * M_TILE * kTileN + i];
    partial[i] = v;  // only this thread touches index i of every warp's tile
  }
  __syncthreads();
}

// Write the CTA's [M_TILE, kTileN] sums (+ bias), or with split-K reduce them in the last CTA.
template <typename T, int M_TILE>
__device__ inline void write_tile(const GemvParams<T>& p, const float* partial) {
  const int col0 = blockIdx.x * kTileN;
  if (p.split > 1) {
    float* ws = p.workspace + static_cast<int64_t>(blockIdx.y) * p.M * p.N;
    for (int i = threadIdx.x; i < M_TILE * kTileN; i += kThreads) {
      const int m = i / kTileN, n = col0 + i % kTileN;
      if (m < p.M && n < p.N) ws[static_cast<int64_t>(m) * p.N + n] = partial[i];
    }
    __threadfence();  // publish the partial before counting this CTA in
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) is_last = atomicAdd(p.locks + blockIdx.x, 1) == p.split - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
  }
  for (int i = threadIdx.x; i < M_TILE * kTileN; i += kThreads) {
    const int m = i / kTileN, n = col0 + i % kTileN;
    if (m >= p.M || n >= p.N) continue;
    const int64_t at = static_cast<int64_t>(m) * p.N + n;
    float v = partial[i];
    if (p.split > 1) {
      v = 0.0f;  // fixed split order: deterministic
      const int64_t plane = static_cast<int64_t>(p.M) * p.N;
      for (int s = 0; s < p.split; ++s) v += __ldcg(p.workspace + s * plane + at);
    }
    if (p.bias != nullptr) v += Pair<T>::to_float(p.bias[n]);
    p.out[at] = Pair<T>::from_float(v);
  }
  if (p.split > 1 && threadIdx.x == 0) atomicExch(p.locks + blockIdx.x, 0);
}

template <typename T, int M_TILE>
__global__ void __launch_bounds__(kThreads) gptq_gemv_kernel(const GemvParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* staged = reinterpret_cast<T*>(smem);  // [M_TILE, span] activations in staged order

  // --- this CTA's columns and K split
  const int tn = threadIdx.x % kThreadsN;
  const int tk = threadIdx.x / kThreadsN;
  const int n0 = blockIdx.x * kTileN + tn * kCols;
  const int num_blocks = (p.K + kBlockK - 1) / kBlockK;
  const int b_begin = blockIdx.y * p.blocks_per_split;
  const int b_end = min(b_begin + p.blocks_per_split, num_blocks);
  const int span = max(b_end - b_begin, 0) * kBlockK;

  // --- stage activations (first weight block already on its way), stream the weights once
  if (n0 < p.N && b_begin + tk < b_end) prefetch_block(p.qweight, b_begin + tk, p.N, n0);
  stage_activations<T, M_TILE>(p, staged, b_begin * kBlockK, span);
  __syncthreads();
  float acc[M_TILE][kCols] = {};
  if (n0 < p.N) {  // N % 8 == 0, so n0 < N means all 4 columns exist
    for (int b = b_begin + tk; b < b_end; b += kThreadsK) {
      accumulate_block<T, M_TILE>(p, staged, span, b, b - b_begin, n0, acc);
    }
  }
  __syncthreads();  // the staged activations are dead: reuse the smem for the reduction

  // --- reduce over the K threads, then write (or split-K fix-up)
  float* partial = reinterpret_cast<float*>(smem);
  reduce_tile<M_TILE>(acc, partial);
  write_tile<T, M_TILE>(p, partial);
}

}  // namespace gptq
}  // namespace pagedq
