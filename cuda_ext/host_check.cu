// Runs the GEMV kernel's per-thread arithmetic on the CPU (no GPU needed), for tests.
//
// Usage: host_check IN OUT. IN holds int32 header [dtype (0 fp16, 1 bf16), M, N, K, group_size,
// num_groups, has_zeros, split], then x [M, K] (16-bit), qweight [Kp/8, N] int32, scales [G, N]
// (16-bit) and, when has_zeros, zeros [G, N] (16-bit). OUT receives fp32 [M, N].
// Every (CTA, thread) of the launch grid is emulated in turn with the kernel's own helpers
// (staged_index, load_group_params, accumulate_block); only the cross-thread reduction is
// replaced by a plain fp32 sum.
#include <cstdio>
#include <vector>

#include "gptq_gemv.cuh"

namespace {

using pagedq::gptq::GemvParams;
using pagedq::gptq::kBlockK;
using pagedq::gptq::kCols;
using pagedq::gptq::kThreadsK;
using pagedq::gptq::kThreadsN;
using pagedq::gptq::kTileN;

struct Problem {
  int dtype, M, N, K, group_size, num_groups, has_zeros, split;
  std::vector<uint16_t> x, scales, zeros;
  std::vector<int32_t> qweight;
};

template <typename V>
bool read_into(FILE* f, std::vector<V>& v, size_t n) {
  v.resize(n);
  return fread(v.data(), sizeof(V), n, f) == n;
}

bool read_problem(const char* path, Problem& pr) {
  FILE* f = fopen(path, "rb");
  if (f == nullptr) return false;
  int header[8];
  bool ok = fread(header, sizeof(int), 8, f) == 8;
  pr = Problem{header[0], header[1], header[2], header[3],
               header[4], header[5], header[6], header[7]};
  const size_t kp = (pr.K + kBlockK - 1) / kBlockK * kBlockK;
  const size_t table = static_cast<size_t>(pr.num_groups) * pr.N;
  ok = ok && read_into(f, pr.x, static_cast<size_t>(pr.M) * pr.K);
  ok = ok && read_into(f, pr.qweight, kp / 8 * pr.N) && read_into(f, pr.scales, table);
  ok = ok && (!pr.has_zeros || read_into(f, pr.zeros, table));
  fclose(f);
  return ok;
}

// One split of one column tile: emulate every thread, sum their accumulators into out.
template <typename T, int M_TILE>
void run_cta(const GemvParams<T>& p, int tile, int split, std::vector<float>& out) {
  const int num_blocks = (p.K + kBlockK - 1) / kBlockK;
  const int b_begin = split * p.blocks_per_split;
  const int b_end = std::min(b_begin + p.blocks_per_split, num_blocks);
  const int span = std::max(b_end - b_begin, 0) * kBlockK;
  std::vector<T> staged(static_cast<size_t>(M_TILE) * span + 8);
  for (int m = 0; m < M_TILE; ++m) {
    for (int kl = 0; kl < span; ++kl) {
      const int k = b_begin * kBlockK + kl;
      const bool inside = m < p.M && k < p.K;
      staged[m * span + pagedq::gptq::staged_index(kl)] =
          inside ? p.x[m * p.x_stride + k] : pagedq::gptq::Pair<T>::from_float(0.0f);
    }
  }
  for (int tn = 0; tn < kThreadsN; ++tn) {
    const int n0 = tile * kTileN + tn * kCols;
    if (n0 >= p.N) continue;
    for (int tk = 0; tk < kThreadsK; ++tk) {
      float acc[M_TILE][kCols] = {};
      for (int b = b_begin + tk; b < b_end; b += kThreadsK) {
        pagedq::gptq::accumulate_block<T, M_TILE>(p, staged.data(), span, b, b - b_begin, n0, acc);
      }
      for (int m = 0; m < p.M; ++m) {
        for (int c = 0; c < kCols; ++c) out[static_cast<size_t>(m) * p.N + n0 + c] += acc[m][c];
      }
    }
  }
}

template <typename T, int M_TILE>
std::vector<float> run(const Problem& pr) {
  GemvParams<T> p{};
  p.x = reinterpret_cast<const T*>(pr.x.data());
  p.qweight = pr.qweight.data();
  p.scales = reinterpret_cast<const T*>(pr.scales.data());
  p.zeros = pr.has_zeros ? reinterpret_cast<const T*>(pr.zeros.data()) : nullptr;
  p.x_stride = pr.K;
  p.M = pr.M;
  p.N = pr.N;
  p.K = pr.K;
  p.group_size = pr.group_size;
  p.num_groups = pr.num_groups;
  const int num_blocks = (pr.K + kBlockK - 1) / kBlockK;
  p.blocks_per_split = (num_blocks + pr.split - 1) / pr.split;
  p.split = (num_blocks + p.blocks_per_split - 1) / p.blocks_per_split;
  std::vector<float> out(static_cast<size_t>(pr.M) * pr.N, 0.0f);
  for (int tile = 0; tile < (pr.N + kTileN - 1) / kTileN; ++tile) {
    for (int s = 0; s < p.split; ++s) run_cta<T, M_TILE>(p, tile, s, out);
  }
  return out;
}

template <typename T>
std::vector<float> run_any(const Problem& pr) {
  if (pr.M <= 1) return run<T, 1>(pr);
  if (pr.M <= 2) return run<T, 2>(pr);
  if (pr.M <= 4) return run<T, 4>(pr);
  if (pr.M <= 8) return run<T, 8>(pr);
  return run<T, 16>(pr);
}

}  // namespace

int main(int argc, char** argv) {
  Problem pr;
  if (argc != 3 || !read_problem(argv[1], pr) || pr.M < 1 || pr.M > 16) {
    fprintf(stderr, "usage: host_check IN OUT (see the header comment)\n");
    return 2;
  }
  const std::vector<float> out = pr.dtype == 0 ? run_any<__half>(pr) : run_any<__nv_bfloat16>(pr);
  FILE* f = fopen(argv[2], "wb");
  if (f == nullptr || fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 1;
  fclose(f);
  return 0;
}
