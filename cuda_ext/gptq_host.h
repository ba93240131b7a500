// Host-side pieces shared by the torch wrappers of the GPTQ ops (gptq_gemv.cu, gptq_gemm.cu):
// input checks (each failure names the op, the value and the limit), the persistent grid size,
// binding the op's tensors to the kernel's parameters, and the launch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

namespace pagedq {
namespace gptq_host {

constexpr int64_t kBlockK = 128;  // input rows per packed block

inline void check_same_device(const at::Tensor& t, const at::Tensor& x, const char* name,
                              const char* op) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), ", x on ",
              x.device());
}

// scales / zeros: [G, n] contiguous, x's dtype, 16-byte aligned (copied in 16-byte pieces).
inline void check_table(const at::Tensor& t, const at::Tensor& x, int64_t n, const char* name,
                        const char* op) {
  check_same_device(t, x, name, op);
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " is ", t.scalar_type(),
              ", x is ", x.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == n && t.is_contiguous(), op, ": ", name,
              " must be a contiguous [G, ", n, "] tensor, got ", t.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must be 16-byte aligned");
}

// Everything both ops need; x has max_m rows at most.
inline void check_inputs(const char* op, int64_t max_m, const at::Tensor& x,
                         const at::Tensor& qweight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& zeros,
                         const std::optional<at::Tensor>& bias, const at::Tensor& workspace,
                         int64_t group_size) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, op, ": x must be a 2-D CUDA tensor, got ", x.sizes(),
              " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
              ": x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_m, op, ": M = ", x.size(0),
              " rows, the kernel takes 1..", max_m);
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && x.size(1) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              op,
              ": x needs unit stride along K, K and the row stride multiples of 8, and a 16-byte "
              "aligned start; got sizes ",
              x.sizes(), " strides ", x.strides());
  check_same_device(qweight, x, "qweight", op);
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              op, ": qweight must be contiguous 2-D int32");
  const int64_t n = qweight.size(1);
  TORCH_CHECK(qweight.size(0) % 16 == 0 && qweight.size(0) * 8 >= x.size(1) &&
                  qweight.size(0) * 8 < x.size(1) + kBlockK,
              op, ": qweight ", qweight.sizes(), " does not hold K = ", x.size(1),
              " rows in 128-row blocks");
  TORCH_CHECK(n % 8 == 0, op, ": N = ", n, " must be a multiple of 8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0, op,
              ": qweight must be 16-byte aligned");
  check_table(scales, x, n, "scales", op);
  if (zeros.has_value()) {
    check_table(*zeros, x, n, "zeros", op);
    TORCH_CHECK(zeros->size(0) == scales.size(0), op, ": zeros and scales differ in groups");
  }
  if (bias.has_value()) {
    check_same_device(*bias, x, "bias", op);
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == n &&
                    bias->is_contiguous(),
                op, ": bias must be a contiguous [", n, "] tensor of x's dtype");
  }
  check_same_device(workspace, x, "workspace", op);
  TORCH_CHECK(workspace.scalar_type() == at::kInt && workspace.is_contiguous(), op,
              ": workspace must be contiguous int32");
  TORCH_CHECK(group_size >= 1 && (scales.size(0) == 1 || group_size % 32 == 0), op,
              ": group_size = ", group_size, " must be a multiple of 32");
}

// Compute capability of `device` as major * 10 + minor, found once per device.
inline int capability(int device) {
  static std::mutex mutex;
  static std::map<int, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return cache.emplace(device, major * 10 + minor).first->second;
}

// Resident CTAs of `kernel` on the whole of `device`: the persistent grid (CTAs of one launch
// wait for each other at split tiles, so the grid must fit on the GPU at once). Found once per
// (kernel, device).
inline int resident_ctas(const char* op, const void* kernel, int threads, size_t smem,
                         int device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  TORCH_CHECK(per_sm > 0, op, ": the kernel does not fit on device ", device);
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return cache.emplace(key, per_sm * sms).first->second;
}

// Dynamic shared memory for a launch of `ctas` CTAs of `kernel` (`smem` bytes each, `resident`
// slots on the device): when ceil(ctas / SMs) is below the slots per SM, padded so that no more
// CTAs than that fit on one SM, and the grid spreads over all SMs. Found once per (kernel, device,
// ctas).
inline size_t spread_smem(const void* kernel, int threads, size_t smem, int ctas, int resident,
                          int device) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, size_t> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, device, ctas);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int sms = 0, per_sm_bytes = 0, reserved = 0, optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int per_sm = resident / sms, want = (ctas + sms - 1) / sms;
  if (want >= per_sm) return cache.emplace(key, smem).first->second;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm_bytes,
                                        cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock,
                                        device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // want + 1 CTAs of this size overflow the SM, want of them fit; the attribute is only a cap
  const size_t padded = std::max<size_t>(smem, per_sm_bytes / (want + 1) - reserved + 128);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  int fits = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, kernel, threads, padded));
  // elsewhere (another limit binds first): no padding, the grid as it would have been
  return cache.emplace(key, fits == want ? padded : smem).first->second;
}

// The problem's shape in the kernel parameters: x [M, K], qweight [Kp/8, N], scales [G, N].
// P: gptq::Params or gptq::GemmParams.
template <typename P>
void set_shape(P& p, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               int64_t group_size) {
  p.M = static_cast<int>(x.size(0));
  p.N = static_cast<int>(qweight.size(1));
  p.K = static_cast<int>(x.size(1));
  p.group_size = static_cast<int>(group_size);
  p.num_groups = static_cast<int>(scales.size(0));
}

// Point the kernel parameters' tensor fields at the op's tensors and a new out [M, N]; returns
// out. P: gptq::Params or gptq::GemmParams.
template <typename P>
at::Tensor bind(P& p, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                at::Tensor& workspace) {
  at::Tensor out = at::empty({x.size(0), qweight.size(1)}, x.options());
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.qweight = qweight.data_ptr<int32_t>();
  p.scales = scales.data_ptr();
  p.zeros = zeros.has_value() ? zeros->data_ptr() : nullptr;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.workspace = reinterpret_cast<float*>(workspace.data_ptr<int32_t>());
  return out;
}

// Launch `kernel` on the current stream, as a programmatic dependent launch when `pdl` (sm_90+:
// the kernels let the next launch start early and wait for the previous one themselves).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int ctas, int threads, size_t smem, bool pdl,
            Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace gptq_host
}  // namespace pagedq
