// Torch-facing wrapper of the GPTQ small-M kernel: checks, device guard, persistent grid size,
// PDL launch on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "gptq_gemv.cuh"

namespace pagedq {
namespace {

void check_same_device(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "gptq_gemv: ", name, " is on ", t.device(), ", x on ",
              x.device());
}

void check_table(const at::Tensor& t, const at::Tensor& x, int64_t n, const char* name) {
  check_same_device(t, x, name);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "gptq_gemv: ", name, " is ", t.scalar_type(),
              ", x is ", x.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == n && t.is_contiguous(), "gptq_gemv: ", name,
              " must be a contiguous [G, ", n, "] tensor, got ", t.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0, "gptq_gemv: ", name,
              " must be 8-byte aligned");
}

void check_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                  const at::Tensor& workspace, int64_t group_size) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "gptq_gemv: x must be a 2-D CUDA tensor, got ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "gptq_gemv: x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "gptq_gemv: M = ", x.size(0),
              " rows, the kernel takes 1..16");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && x.size(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "gptq_gemv: x needs unit stride along K, K and the row stride multiples of 8, and a "
              "16-byte aligned start; got sizes ", x.sizes(), " strides ", x.strides());
  check_same_device(qweight, x, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              "gptq_gemv: qweight must be contiguous 2-D int32");
  const int64_t n = qweight.size(1);
  TORCH_CHECK(qweight.size(0) % 16 == 0 && qweight.size(0) * 8 >= x.size(1) &&
                  qweight.size(0) * 8 < x.size(1) + gptq::kBlockK,
              "gptq_gemv: qweight ", qweight.sizes(), " does not hold K = ", x.size(1),
              " rows in 128-row blocks");
  TORCH_CHECK(n % 8 == 0, "gptq_gemv: N = ", n, " must be a multiple of 8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0,
              "gptq_gemv: qweight must be 16-byte aligned");
  check_table(scales, x, n, "scales");
  if (zeros.has_value()) {
    check_table(*zeros, x, n, "zeros");
    TORCH_CHECK(zeros->size(0) == scales.size(0), "gptq_gemv: zeros and scales differ in groups");
  }
  if (bias.has_value()) {
    check_same_device(*bias, x, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(),
                "gptq_gemv: bias must be a contiguous [", n, "] tensor of x's dtype");
  }
  check_same_device(workspace, x, "workspace");
  TORCH_CHECK(workspace.scalar_type() == at::kInt && workspace.is_contiguous(),
              "gptq_gemv: workspace must be contiguous int32");
  TORCH_CHECK(group_size >= 1 && (scales.size(0) == 1 || group_size % 32 == 0),
              "gptq_gemv: group_size = ", group_size, " must be a multiple of 32");
}

using KernelFn = void (*)(gptq::Params);

template <typename T, int TOK>
KernelFn kernel_for_tok(bool per_quarter) {
  return per_quarter ? gptq::gptq_gemv_kernel<T, TOK, true> : gptq::gptq_gemv_kernel<T, TOK, false>;
}

template <int TOK>
size_t smem_for_tok(bool per_quarter) {
  return per_quarter ? gptq::smem_bytes<TOK, true>() : gptq::smem_bytes<TOK, false>();
}

// The kernel and its shared memory for `tokens` (<= 16) rows.
template <typename T>
std::pair<KernelFn, size_t> variant(int tokens, bool per_quarter) {
  if (tokens <= 1) return {kernel_for_tok<T, 1>(per_quarter), smem_for_tok<1>(per_quarter)};
  if (tokens <= 2) return {kernel_for_tok<T, 2>(per_quarter), smem_for_tok<2>(per_quarter)};
  if (tokens <= 4) return {kernel_for_tok<T, 4>(per_quarter), smem_for_tok<4>(per_quarter)};
  if (tokens <= 8) return {kernel_for_tok<T, 8>(per_quarter), smem_for_tok<8>(per_quarter)};
  return {kernel_for_tok<T, 16>(per_quarter), smem_for_tok<16>(per_quarter)};
}

struct Launch {
  int ctas;  // resident CTAs on the whole device: the persistent grid (CTAs of one launch wait
            // for each other at split tiles, so the grid must fit on the GPU at once)
  bool pdl;  // programmatic dependent launch (Hopper and newer)
};

// How `kernel` launches on `device`, computed once per (kernel, device).
Launch launch_for(KernelFn kernel, size_t smem, int device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, Launch> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  int per_sm = 0, sms = 0, major = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, gptq::kThreads, smem));
  TORCH_CHECK(per_sm > 0, "gptq_gemv: the kernel does not fit on device ", device);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const Launch launch{per_sm * sms, major >= 9};
  cache.emplace(key, launch);
  return launch;
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
               at::Tensor& workspace, int64_t group_size) {
  const int device = x.device().index();
  gptq::Params p{};
  p.M = static_cast<int>(x.size(0));
  p.N = static_cast<int>(qweight.size(1));
  p.K = static_cast<int>(x.size(1));
  p.group_size = static_cast<int>(group_size);
  p.num_groups = static_cast<int>(scales.size(0));
  p.tiles = (p.N + gptq::kTileN - 1) / gptq::kTileN;
  p.num_blocks = (p.K + gptq::kBlockK - 1) / gptq::kBlockK;
  const bool per_quarter = p.num_groups > 1 && group_size % gptq::kBlockK != 0;
  const auto [kernel, smem] = variant<T>(p.M, per_quarter);
  const int64_t items = static_cast<int64_t>(p.tiles) * p.num_blocks;
  const Launch launch = launch_for(kernel, smem, device);
  const int ctas = static_cast<int>(
      std::min<int64_t>({launch.ctas, items, int64_t{gptq::kMaxSharers} * p.tiles}));

  const int64_t slots = int64_t{ctas} * p.M * gptq::kTileN;
  TORCH_CHECK(workspace.numel() >= slots, "gptq_gemv: ", ctas, " CTAs x ", p.M, " rows x ",
              gptq::kTileN, " columns need a workspace of ", slots, " values, got ",
              workspace.numel());
  at::Tensor out = at::empty({p.M, p.N}, x.options());
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.qweight = qweight.data_ptr<int32_t>();
  p.scales = scales.data_ptr();
  p.zeros = zeros.has_value() ? zeros->data_ptr() : nullptr;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.workspace = reinterpret_cast<float*>(workspace.data_ptr<int32_t>());

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(gptq::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = pdl;
  config.numAttrs = launch.pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  return out;
}

}  // namespace

// Declared in bindings.cpp, which registers it as pagedq::gptq_gemv.
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size) {
  check_inputs(x, qweight, scales, zeros, bias, workspace, group_size);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  if (x.scalar_type() == at::kHalf) {
    return run<__half>(x, qweight, scales, zeros, bias, workspace, group_size);
  }
  return run<__nv_bfloat16>(x, qweight, scales, zeros, bias, workspace, group_size);
}

}  // namespace pagedq
