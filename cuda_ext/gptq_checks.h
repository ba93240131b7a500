// Input checks shared by the torch wrappers of the GPTQ ops (gptq_gemv.cu, gptq_gemm.cu): each
// failure names the op, the value and the limit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace pagedq {
namespace gptq_checks {

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

}  // namespace gptq_checks
}  // namespace pagedq
