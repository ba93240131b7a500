// dev variant: the wgmma GEMV (gptq_gemv.cuh, namespace wg) behind the gptq_gemv op.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "gptq_host.h"
#include "gptq_gemv.cuh"

namespace pagedq {
namespace {

using KernelFn = void (*)(gptq::Params);

template <typename T, int NT>
std::pair<KernelFn, size_t> pick(bool pq) {
  if (pq) return {gptq::wg::kernel<T, NT, true>, gptq::wg::smem_bytes<NT, true>()};
  return {gptq::wg::kernel<T, NT, false>, gptq::wg::smem_bytes<NT, false>()};
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 ? std::atoi(v) : fallback;
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
               at::Tensor& workspace, int64_t group_size) {
  const int device = x.device().index();
  gptq::Params p{};
  gptq_host::set_shape(p, x, qweight, scales, group_size);
  p.tiles = (p.N + gptq::kTileN - 1) / gptq::kTileN;
  p.num_blocks = (p.K + gptq::kBlockK - 1) / gptq::kBlockK;
  const bool pq = p.num_groups > 1 && group_size % gptq::kBlockK != 0;
  const int nt = p.M > 8 ? 16 : 8;
  const auto [kernel, smem] = nt == 16 ? pick<T, 16>(pq) : pick<T, 8>(pq);
  const int resident = gptq_host::resident_ctas(
      "gptq_gemv", reinterpret_cast<const void*>(kernel), gptq::wg::kThreads, smem, device);
  const int64_t cap = p.num_blocks > 32 ? env_int("PQ_WG_CAPD", 5) : env_int("PQ_WG_CAP", 4);
  const int64_t items = int64_t{p.tiles} * p.num_blocks;
  const int limit = env_int("PQ_WG_CTAS", 0);
  int ctas = static_cast<int>(std::min<int64_t>({resident, items, cap * p.tiles}));
  if (limit > 0) ctas = std::min(ctas, limit);

  const int64_t slots = int64_t{ctas} * nt * gptq::kTileN;
  TORCH_CHECK(workspace.numel() >= slots, "gptq_gemv: workspace too small");
  at::Tensor out = gptq_host::bind(p, x, qweight, scales, zeros, bias, workspace);
  const bool pdl = gptq_host::capability(device) >= 90;
  gptq_host::launch(kernel, ctas, gptq::wg::kThreads, smem, pdl, p);
  if (env_int("PQ_WG_VERBOSE", 0)) {
    static bool once = false;
    if (!once) {
      once = true;
      fprintf(stderr, "wg: resident %d smem %zu\n", resident, smem);
    }
  }
  return out;
}

}  // namespace

at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size) {
  gptq_host::check_inputs("gptq_gemv", 16, x, qweight, scales, zeros, bias, workspace,
                          group_size);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  if (x.scalar_type() == at::kHalf) {
    return run<__half>(x, qweight, scales, zeros, bias, workspace, group_size);
  }
  return run<__nv_bfloat16>(x, qweight, scales, zeros, bias, workspace, group_size);
}

}  // namespace pagedq
