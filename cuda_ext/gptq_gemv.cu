// Torch-facing wrapper of the GPTQ GEMV kernel: checks, device guard, current stream, launch.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "gptq_gemv.cuh"

namespace pagedq {
namespace {

constexpr int kMTiles[] = {1, 2, 4, 8, 16};  // row counts the kernel is compiled for

int m_tile_for(int64_t m) {
  for (int t : kMTiles) {
    if (m <= t) return t;
  }
  return 0;
}

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
                  const at::Tensor& locks, int64_t group_size, int64_t split_k) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2, "gptq_gemv: x must be a 2-D CUDA tensor, got ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "gptq_gemv: x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "gptq_gemv: M = ", x.size(0),
              " rows, the kernel takes 1..16");
  TORCH_CHECK(x.stride(1) == 1, "gptq_gemv: x must have unit stride along K");
  check_same_device(qweight, x, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(),
              "gptq_gemv: qweight must be contiguous 2-D int32");
  const int64_t n = qweight.size(1);
  TORCH_CHECK(qweight.size(0) % gptq::kWordRows == 0 && qweight.size(0) * 8 >= x.size(1) &&
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
  check_same_device(locks, x, "locks");
  TORCH_CHECK(locks.scalar_type() == at::kInt && locks.is_contiguous(),
              "gptq_gemv: locks must be contiguous int32");
  TORCH_CHECK(group_size >= 1 && (scales.size(0) == 1 || group_size % 32 == 0),
              "gptq_gemv: group_size = ", group_size, " must be a multiple of 32");
  TORCH_CHECK(split_k >= 1, "gptq_gemv: split_k = ", split_k, " must be >= 1");
}

template <typename T, int M_TILE>
void launch_tile(const gptq::GemvParams<T>& p, dim3 grid, size_t smem, cudaStream_t stream) {
  gptq::gptq_gemv_kernel<T, M_TILE><<<grid, gptq::kThreads, smem, stream>>>(p);
}

template <typename T>
void launch(const gptq::GemvParams<T>& p, int m_tile, dim3 grid, size_t smem, cudaStream_t stream) {
  switch (m_tile) {
    case 1: launch_tile<T, 1>(p, grid, smem, stream); break;
    case 2: launch_tile<T, 2>(p, grid, smem, stream); break;
    case 4: launch_tile<T, 4>(p, grid, smem, stream); break;
    case 8: launch_tile<T, 8>(p, grid, smem, stream); break;
    default: launch_tile<T, 16>(p, grid, smem, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
gptq::GemvParams<T> make_params(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                const std::optional<at::Tensor>& bias, at::Tensor& locks,
                                at::Tensor& out, at::Tensor& workspace) {
  gptq::GemvParams<T> p{};
  p.x = reinterpret_cast<const T*>(x.data_ptr());
  p.qweight = qweight.data_ptr<int32_t>();
  p.scales = reinterpret_cast<const T*>(scales.data_ptr());
  p.zeros = zeros.has_value() ? reinterpret_cast<const T*>(zeros->data_ptr()) : nullptr;
  p.bias = bias.has_value() ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  p.out = reinterpret_cast<T*>(out.data_ptr());
  p.workspace = workspace.defined() ? workspace.data_ptr<float>() : nullptr;
  p.locks = locks.data_ptr<int32_t>();
  p.x_stride = x.stride(0);
  p.M = static_cast<int>(x.size(0));
  p.N = static_cast<int>(qweight.size(1));
  p.K = static_cast<int>(x.size(1));
  return p;
}

}  // namespace

// Declared in bindings.cpp, which registers it as pagedq::gptq_gemv.
at::Tensor gptq_gemv_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& locks,
                          int64_t group_size, int64_t split_k) {
  check_inputs(x, qweight, scales, zeros, bias, locks, group_size, split_k);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t m = x.size(0), n = qweight.size(1);
  const int64_t num_blocks = (x.size(1) + gptq::kBlockK - 1) / gptq::kBlockK;
  const int64_t per_split = (num_blocks + split_k - 1) / split_k;
  const int64_t split = (num_blocks + per_split - 1) / per_split;  // no empty split
  const int m_tile = m_tile_for(m);
  const int64_t staged = m_tile * per_split * gptq::kBlockK * x.element_size();
  TORCH_CHECK(staged <= gptq::kMaxStagedBytes, "gptq_gemv: split_k = ", split_k, " stages ", staged,
              " bytes of activations per CTA, the limit is ", gptq::kMaxStagedBytes);
  const int64_t tiles = (n + gptq::kTileN - 1) / gptq::kTileN;
  TORCH_CHECK(split == 1 || locks.numel() >= tiles, "gptq_gemv: ", tiles,
              " column tiles need as many locks, got ", locks.numel());

  at::Tensor out = at::empty({m, n}, x.options());
  at::Tensor workspace;
  if (split > 1) workspace = at::empty({split, m, n}, x.options().dtype(at::kFloat));
  const int64_t reduce_bytes = int64_t{gptq::kWarps} * m_tile * gptq::kTileN * 4;
  const size_t smem = static_cast<size_t>(std::max(staged, reduce_bytes));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(split));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (x.scalar_type() == at::kHalf) {
    auto p = make_params<__half>(x, qweight, scales, zeros, bias, locks, out, workspace);
    p.group_size = static_cast<int>(group_size);
    p.num_groups = static_cast<int>(scales.size(0));
    p.blocks_per_split = static_cast<int>(per_split);
    p.split = static_cast<int>(split);
    launch<__half>(p, m_tile, grid, smem, stream);
  } else {
    auto p = make_params<__nv_bfloat16>(x, qweight, scales, zeros, bias, locks, out, workspace);
    p.group_size = static_cast<int>(group_size);
    p.num_groups = static_cast<int>(scales.size(0));
    p.blocks_per_split = static_cast<int>(per_split);
    p.split = static_cast<int>(split);
    launch<__nv_bfloat16>(p, m_tile, grid, smem, stream);
  }
  return out;
}

}  // namespace pagedq
