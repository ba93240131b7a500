// Torch-facing wrapper of the GPTQ small-M kernel: checks, device guard, persistent grid size,
// PDL launch on the current stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <utility>

#include "gptq_host.h"
#include "gptq_gemv.cuh"

namespace pagedq {
namespace {

using KernelFn = void (*)(gptq::Params);

template <typename T, int TOK>
KernelFn kernel_for_tok(bool per_quarter) {
  return per_quarter ? gptq::gptq_gemv_kernel<T, TOK, true> : gptq::gptq_gemv_kernel<T, TOK, false>;
}

template <int TOK>
size_t smem_for_tok(bool per_quarter) {
  return per_quarter ? gptq::smem_bytes<TOK, true>() : gptq::smem_bytes<TOK, false>();
}

// The kernel's token count TOK for `tokens` (<= 16) rows.
constexpr int tok_bucket(int tokens) {
  return tokens <= 1 ? 1 : tokens <= 2 ? 2 : tokens <= 4 ? 4 : tokens <= 8 ? 8 : 16;
}

// The kernel and its shared memory for TOK = `tok` (a tok_bucket value).
template <typename T>
std::pair<KernelFn, size_t> variant(int tok, bool per_quarter) {
  switch (tok) {
    case 1: return {kernel_for_tok<T, 1>(per_quarter), smem_for_tok<1>(per_quarter)};
    case 2: return {kernel_for_tok<T, 2>(per_quarter), smem_for_tok<2>(per_quarter)};
    case 4: return {kernel_for_tok<T, 4>(per_quarter), smem_for_tok<4>(per_quarter)};
    case 8: return {kernel_for_tok<T, 8>(per_quarter), smem_for_tok<8>(per_quarter)};
    default: return {kernel_for_tok<T, 16>(per_quarter), smem_for_tok<16>(per_quarter)};
  }
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
  const bool per_quarter = p.num_groups > 1 && group_size % gptq::kBlockK != 0;
  const int tok = tok_bucket(p.M);
  const auto [kernel, smem] = variant<T>(tok, per_quarter);
  const int resident = gptq_host::resident_ctas(
      "gptq_gemv", reinterpret_cast<const void*>(kernel), gptq::kThreads, smem, device);
  const int64_t sharers = gptq::max_sharers(p.M, p.num_blocks);
  // the kernel splits its work by slices_for(TOK), and so must the grid
  const int slices = gptq::slices_for(tok);
  const int64_t runs = gptq::gemv_split(p, 1, slices).runs;
  const int ctas = static_cast<int>(std::min<int64_t>({resident, runs, sharers * p.tiles}));
  // A pairs' grid smaller than the resident slots (the capped o and down at 16 tokens: 256 CTAs,
  // 3 slots per SM) would be packed onto fewer SMs; padded shared memory keeps it to ceil(ctas /
  // SMs).
  const size_t launch_smem =
      slices < gptq::kWarps
          ? gptq_host::spread_smem(reinterpret_cast<const void*>(kernel), gptq::kThreads, smem,
                                   ctas, resident, device)
          : smem;

  const int64_t slots = int64_t{ctas} * p.M * gptq::kTileN;
  TORCH_CHECK(workspace.numel() >= slots, "gptq_gemv: ", ctas, " CTAs x ", p.M, " rows x ",
              gptq::kTileN, " columns need a workspace of ", slots, " values, got ",
              workspace.numel());
  at::Tensor out = gptq_host::bind(p, x, qweight, scales, zeros, bias, workspace);
  const bool pdl = gptq_host::capability(device) >= 90;  // programmatic dependent launch
  gptq_host::launch(kernel, ctas, gptq::kThreads, launch_smem, pdl, p);
  return out;
}

}  // namespace

// Declared in bindings.cpp, which registers it as pagedq::gptq_gemv.
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
