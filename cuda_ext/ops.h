// Torch-facing entry points of the pagedq CUDA extension (registered in bindings.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace pagedq {

// out [M, N] = x [M, K] @ W^T (+ bias) for M <= 16, W packed as in pagedq/ops/gptq.py.
// locks: split-K arrival counters (all zero between calls, reset by the kernel).
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& locks,
                          int64_t group_size, int64_t split_k);

}  // namespace pagedq
