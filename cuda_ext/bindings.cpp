// Registers the extension's ops as torch custom ops (pagedq::*); fake kernels live in build.py.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_FRAGMENT(pagedq, m) {
  m.def(
      "gptq_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
      "Tensor(a!) locks, int group_size, int split_k) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedq, CUDA, m) { m.impl("gptq_gemv", &pagedq::gptq_gemv_cuda); }
