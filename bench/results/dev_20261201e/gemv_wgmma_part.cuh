
// ===================== dev: a wgmma GEMV (sm_90a), one warpgroup per CTA =====================
// Items (64-column tile, 128-row block) tile-major, runs of one block; CTA c takes the stream-K
// range of gemv_split-like Split(tiles, nb, 1, ctas). All 4 warps work on one block: warp w
// dequantizes columns 16w + 2g (+1) into wgmma A fragments; x [NT tokens x 128] is the B operand
// (K-major, 128-byte swizzle) in the stage. The CTA's copies (weights, scales, zeros, x) go
// through a ring of kS stages, kA blocks ahead, by cp.async from all threads; one barrier per
// block. Accumulators: m64nNTk16 fragments, a thread's NT / 2 floats; split tiles go through
// the workspace in fragment order (thread-local: no shared memory at the end).
namespace wg {

constexpr int kThreads = 128;
constexpr int kWordStride = kTileN + 8;  // words per smem word row

#ifndef WG_STAGES16
#define WG_STAGES16 6
#endif
#ifndef WG_STAGES8
#define WG_STAGES8 7
#endif
#ifndef WG_CHAINS
#define WG_CHAINS 4
#endif
constexpr int kChains = WG_CHAINS;  // independent accumulator sets (wgmma dependency chains)
#ifndef WG_MINB
#define WG_MINB 4
#endif

template <int NT>
__host__ __device__ constexpr int stages() {
  return NT > 8 ? WG_STAGES16 : WG_STAGES8;
}

template <int NT, bool PQ>
struct Stage {
  static constexpr int kQ = PQ ? 4 : 1;
  static constexpr int kXHalf = NT * 128;
  static constexpr int kX = 0;
  static constexpr int kW = 2 * kXHalf;
  static constexpr int kS = kW + 16 * kWordStride * 4;
  static constexpr int kZ = kS + kQ * kTileN * 2;
  static constexpr int kBytes = (kZ + kQ * kTileN * 2 + 1023) / 1024 * 1024;
};

template <int NT, bool PQ>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(Stage<NT, PQ>::kBytes) * stages<NT>() + 1024;
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
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
__device__ inline uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

template <typename T, int NT>
struct Mma;
template <typename T>
struct Mma<T, 8> {
  __device__ static void run(float (&d)[4], const uint32_t (&a)[4], uint64_t b, uint32_t keep) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (std::is_same_v<T, __half>) {
      asm volatile(
          "{ .reg .pred p; setp.ne.b32 p, %9, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0; }"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(keep));
    } else {
      asm volatile(
          "{ .reg .pred p; setp.ne.b32 p, %9, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0; }"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(keep));
    }
#endif
  }
};
template <typename T>
struct Mma<T, 16> {
  __device__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t b, uint32_t keep) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (std::is_same_v<T, __half>) {
      asm volatile(
          "{ .reg .pred p; setp.ne.b32 p, %13, 0; "
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(keep));
    } else {
      asm volatile(
          "{ .reg .pred p; setp.ne.b32 p, %13, 0; "
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(keep));
    }
#endif
  }
};

// Copy the CTA's share of item (tile, b) into stage st: weights/scales/zeros and/or x.
template <int NT, bool PQ, bool Z>
__device__ inline void issue(const Params& p, int tile, int b, unsigned char* st, bool weights,
                             bool with_x) {
  using S = Stage<NT, PQ>;
  const int tid = threadIdx.x;
  const int col0 = tile * kTileN;
  if (weights) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = tid + kThreads * h, r = c / 16, cc = c % 16;
      const bool ok = col0 + 4 * cc < p.N;
      cp_async<16>(st + S::kW + (r * kWordStride + 4 * cc) * 4,
                   p.qweight + (static_cast<int64_t>(b) * 16 + r) * p.N + col0 + 4 * cc, ok);
    }
    if (tid < 8 * S::kQ) {
      const int q = tid / 8, cc = tid % 8;
      const bool ok = col0 + 8 * cc < p.N;
      const int64_t at = group_row(p, b, q) * p.N + col0 + 8 * cc;
      cp_async<16>(st + S::kS + q * kTileN * 2 + cc * 16,
                   static_cast<const uint16_t*>(p.scales) + at, ok);
    } else if (Z && tid < 16 * S::kQ) {
      const int q = tid / 8 - S::kQ, cc = tid % 8;
      const bool ok = col0 + 8 * cc < p.N;
      const int64_t at = group_row(p, b, q) * p.N + col0 + 8 * cc;
      cp_async<16>(st + S::kZ + q * kTileN * 2 + cc * 16,
                   static_cast<const uint16_t*>(p.zeros) + at, ok);
    }
  }
  if (with_x) {
#pragma unroll
    for (int h = 0; h < NT / 8; ++h) {
      const int c = tid + kThreads * h;
      const int hh = c / (8 * NT), n = c / 8 % NT, ch = c % 8;
      const int k = b * kBlockK + 64 * hh + 8 * ch;
      const bool ok = n < p.M && k < p.K;
      cp_async<16>(st + S::kX + hh * S::kXHalf + n * 128 + ((ch ^ (n % 8)) * 16),
                   static_cast<const uint16_t*>(p.x) + static_cast<int64_t>(ok ? n : 0) *
                   p.x_stride + (ok ? k : 0), ok);
    }
  }
}

// Dequantize stage st into A fragments and issue its 8 wgmmas (keep = 0: overwrite acc).
template <typename T, int NT, bool PQ, bool Z>
__device__ inline void compute(const unsigned char* st, float (&acc)[kChains][NT / 2], bool fresh) {
  using S = Stage<NT, PQ>;
  constexpr uint32_t kMagic = Dtype<T>::kMagicBits;
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int col = 16 * (tid / 32) + 2 * g;
  uint2 w[4];  // word rows t + 4j, columns col, col + 1
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = *reinterpret_cast<const uint2*>(st + S::kW + ((t + 4 * j) * kWordStride + col) * 4);
  }
  uint32_t a[8][4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int q = PQ ? p : 0;
    const uint32_t s2 = *reinterpret_cast<const uint32_t*>(st + S::kS + (q * kTileN + col) * 2);
    const uint32_t z2 =
        Z ? *reinterpret_cast<const uint32_t*>(st + S::kZ + (q * kTileN + col) * 2) : 0u;
    uint32_t sc[2], zb[2];
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
      for (int r = 0; r < 4; ++r) {
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
        a[2 * p + s][r] = mul2<T>(d, sc[e]);
      }
    }
  }
#pragma unroll
  for (int sl = 0; sl < 8; ++sl) fence_regs(a[sl]);
  wgmma_fence();
  const uint32_t x_addr = smem_addr(st + S::kX);
#pragma unroll
  for (int sl = 0; sl < 8; ++sl) {  // slice (p, s) = (sl / 2, sl % 2)
    const int p = sl / 2, s = sl % 2;
    const uint64_t desc = smem_desc(x_addr + (p / 2) * S::kXHalf + 64 * (p % 2) + 32 * s);
    Mma<T, NT>::run(acc[sl % kChains], a[sl], desc, !(fresh && sl < kChains));
  }
  wgmma_commit();
}

template <int NT>
__device__ inline float* slot_piece(const Params& p, int cta, int v) {
  return p.workspace + ((static_cast<int64_t>(cta) * (NT / 8) + v) * kThreads + threadIdx.x) * 4;
}

template <typename T, int NT>
__device__ inline void write_out(const Params& p, int tile, const float (&acc)[NT / 2]) {
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int col = tile * kTileN + 16 * (tid / 32) + 2 * g;
  if (col >= p.N) return;
  float b0 = 0.f, b1 = 0.f;
  if (p.bias != nullptr) {
    b0 = Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[col]);
    b1 = Dtype<T>::to_float(static_cast<const uint16_t*>(p.bias)[col + 1]);
  }
#pragma unroll
  for (int i = 0; i < NT / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 8 * i + 2 * t + e;
      if (m >= p.M) continue;
      const uint32_t lo = Dtype<T>::from_float(acc[4 * i + e] + b0);
      const uint32_t hi = Dtype<T>::from_float(acc[4 * i + 2 + e] + b1);
      *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.out) + static_cast<int64_t>(m) * p.N +
                                   col) = lo | (hi << 16);
    }
  }
}

template <typename T, int NT, bool PQ, bool Z>
__device__ inline void body(const Params& p) {
  using S = Stage<NT, PQ>;
  constexpr int kS = stages<NT>(), kA = kS - 1;
  extern __shared__ __align__(16) unsigned char wg_smem[];
  const uint32_t raw = smem_addr(wg_smem);
  unsigned char* ring = wg_smem + ((1024 - raw % 1024) % 1024);
  pdl_launch_dependents();

  const Split split(p.tiles, p.num_blocks, 1, gridDim.x);
  const int64_t begin = split.begin(blockIdx.x), end = split.end(blockIdx.x);
  const int nb = p.num_blocks;
  // copy cursor: the next item to copy
  int64_t ci = begin;
  int ctile = static_cast<int>(begin / nb), cb = static_cast<int>(begin % nb);
  auto advance_copy = [&]() {
    ++ci;
    if (++cb == nb) {
      cb = 0;
      ++ctile;
    }
  };
#pragma unroll
  for (int i = 0; i < kA; ++i) {
    if (begin + i < end) {
      const int64_t it = begin + i;
      issue<NT, PQ, Z>(p, static_cast<int>(it / nb), static_cast<int>(it % nb),
                       ring + i * S::kBytes, true, false);
    }
  }
  cp_async_commit();
  pdl_wait();
#pragma unroll
  for (int i = 0; i < kA; ++i) {
    if (ci < end) issue<NT, PQ, Z>(p, ctile, cb, ring + i * S::kBytes, false, true);
    advance_copy();
    cp_async_commit();
  }

  float chains[kChains][NT / 2];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) chains[c][i] = 0.f;
  }
  float acc[NT / 2];
  int owned = -1;
  int stage = 0, fill = kA;
  int tile = static_cast<int>(begin / nb), b = static_cast<int>(begin % nb);
  int sb0 = b;  // the current segment's first block
  for (int64_t it = begin; it < end; ++it) {
    cp_async_wait<kA - 1>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();  // item it has landed for all threads; item it - 1's stage is free
    if (ci < end) issue<NT, PQ, Z>(p, ctile, cb, ring + fill * S::kBytes, true, true);
    advance_copy();
    cp_async_commit();
    fill = fill + 1 == kS ? 0 : fill + 1;

    compute<T, NT, PQ, Z>(ring + stage * S::kBytes, chains, b == sb0);
    stage = stage + 1 == kS ? 0 : stage + 1;
    wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < kChains; ++c) fence_regs(chains[c]);
    if (it + 1 == end || b + 1 == nb) {  // the segment [sb0, b] of `tile` ends
#pragma unroll
      for (int i = 0; i < NT / 2; ++i) {
        acc[i] = chains[0][i];
#pragma unroll
        for (int c = 1; c < kChains; ++c) acc[i] += chains[c][i];
      }
      if (sb0 == 0 && b == nb - 1) {
        write_out<T, NT>(p, tile, acc);
      } else if (sb0 == 0) {
        owned = tile;  // the CTA's last segment: acc stays for the finish
      } else {
#pragma unroll
        for (int v = 0; v < NT / 8; ++v) {
          store_slot4(slot_piece<NT>(p, blockIdx.x, v), acc[4 * v], acc[4 * v + 1],
                      acc[4 * v + 2], acc[4 * v + 3]);
        }
      }
    }
    if (++b == nb) {
      b = 0;
      ++tile;
      sb0 = 0;
    }
  }
  cp_async_wait<0>();
  if (owned < 0) return;
  int first, last;
  split.contributors(owned, first, last);
  const float empty = __uint_as_float(kEmpty);
  for (int c0 = first + 1; c0 <= last; c0 += kReadsInFlight) {
    uint4 bits[kReadsInFlight][NT / 8];
#pragma unroll
    for (int c = 0; c < kReadsInFlight; ++c) {
#pragma unroll
      for (int v = 0; v < NT / 8; ++v) {
        if (c0 + c <= last) bits[c][v] = load_slot4(slot_piece<NT>(p, c0 + c, v));
      }
    }
#pragma unroll
    for (int c = 0; c < kReadsInFlight; ++c) {
      if (c0 + c > last) break;
#pragma unroll
      for (int v = 0; v < NT / 8; ++v) {
        float* at = slot_piece<NT>(p, c0 + c, v);
        while (any_empty(bits[c][v])) bits[c][v] = load_slot4(at);
        acc[4 * v] += __uint_as_float(bits[c][v].x);
        acc[4 * v + 1] += __uint_as_float(bits[c][v].y);
        acc[4 * v + 2] += __uint_as_float(bits[c][v].z);
        acc[4 * v + 3] += __uint_as_float(bits[c][v].w);
        store_slot4(at, empty, empty, empty, empty);
      }
    }
  }
  write_out<T, NT>(p, owned, acc);
}

template <typename T, int NT, bool PQ>
__global__ void __launch_bounds__(kThreads, WG_MINB) kernel(const Params p) {
  if (p.zeros != nullptr) {
    body<T, NT, PQ, true>(p);
  } else {
    body<T, NT, PQ, false>(p);
  }
}

}  // namespace wg
