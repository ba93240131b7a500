// The one bindings file: registers the extension's ops as torch custom ops (pagedq::*).
// Fake (meta) kernels are registered from Python in build.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace pagedq {

// gptq_gemv.cu: out [M, N] = x [M, K] @ W^T (+ bias) for M <= 16, W packed as in
// pagedq/ops/gptq.py; workspace [>= CTAs * M * 64] int32 holds the split tiles' fp32 partial sums
// and is all -1 (empty) between calls, which run one at a time.
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size);

// gptq_gemm.cu: the same product for any M on sm_90 (wgmma), tiles of tile_tokens rows (64, 128
// or 256) x 256 columns (128 for 256 rows); workspace [>= CTAs * 256 * min(tile_tokens, 128)]
// int32, the same protocol.
at::Tensor gptq_gemm_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size, int64_t tile_tokens);

}  // namespace pagedq

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "gptq_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
      "Tensor(a!) workspace, int group_size) -> Tensor");
  m.def(
      "gptq_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
      "Tensor(a!) workspace, int group_size, int tile_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedq, CUDA, m) {
  m.impl("gptq_gemv", &pagedq::gptq_gemv_cuda);
  m.impl("gptq_gemm", &pagedq::gptq_gemm_cuda);
}
