// Torch-facing wrapper of the GPTQ wgmma GEMM (Hopper, sm_90a): checks, the activations' tensor
// map, persistent grid size, PDL launch on the current stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudaTypedefs.h>

#include "gptq_host.h"
#include "gptq_gemm.cuh"

namespace pagedq {
namespace {

using GemmFn = void (*)(gptq::GemmParams, CUtensorMap);

struct GemmVariant {
  GemmFn kernel;
  size_t smem;
  int cols;    // output columns per tile
  int values;  // workspace values per CTA
};

template <typename T, int BT>
GemmVariant gemm_variant(bool per_quarter) {
  using Tile = gptq::GemmTile<BT>;
  constexpr int values = gptq::kGemmThreads * 4 * Tile::kPieces;
  if (per_quarter) {
    return {gptq::gptq_gemm_kernel<T, BT, true>, gptq::gemm_smem_bytes<BT, true>(), Tile::kCols,
            values};
  }
  return {gptq::gptq_gemm_kernel<T, BT, false>, gptq::gemm_smem_bytes<BT, false>(), Tile::kCols,
          values};
}

template <typename T>
GemmVariant gemm_variant(int bt, bool per_quarter) {
  if (bt == 64) return gemm_variant<T, 64>(per_quarter);
  if (bt == 128) return gemm_variant<T, 128>(per_quarter);
  return gemm_variant<T, 256>(per_quarter);
}

// x [M, K] as the kernel's tensor map: boxes of 64 k x BT rows, 128-byte swizzle, zeros outside.
CUtensorMap x_tensor_map(const at::Tensor& x, int bt) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "gptq_gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(x.size(1)),
                              static_cast<cuuint64_t>(x.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(x.stride(0)) * 2};  // bytes
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(bt)};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult rc = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, x.data_ptr(), dims, strides,
                             box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                             CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(rc == CUDA_SUCCESS, "gptq_gemm: cuTensorMapEncodeTiled failed (", int(rc),
              ") for x ", x.sizes(), " strides ", x.strides());
  return map;
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
               at::Tensor& workspace, int64_t group_size, int bt) {
  const int device = x.device().index();
  gptq::GemmParams p{};
  gptq_host::set_shape(p, x, qweight, scales, group_size);
  const bool per_quarter = p.num_groups > 1 && group_size % gptq::kBlockK != 0;
  const GemmVariant v = gemm_variant<T>(bt, per_quarter);
  p.tiles_m = (p.M + bt - 1) / bt;
  p.tiles_n = (p.N + v.cols - 1) / v.cols;
  p.num_blocks = (p.K + gptq::kBlockK - 1) / gptq::kBlockK;
  const int64_t items = int64_t{p.tiles_m} * p.tiles_n * p.num_blocks;
  TORCH_CHECK(items < (int64_t{1} << 31), "gptq_gemm: ", items, " work items, at most 2^31 - 1");
  const int resident = gptq_host::resident_ctas(
      "gptq_gemm", reinterpret_cast<const void*>(v.kernel), gptq::kGemmBlock, v.smem, device);
  const int ctas = gptq::gemm_grid(int64_t{p.tiles_m} * p.tiles_n, p.num_blocks, resident, p.split);
  const int64_t slots = int64_t{ctas} * v.values;
  TORCH_CHECK(workspace.numel() >= slots, "gptq_gemm: ", ctas, " CTAs x ", v.values,
              " values need a workspace of ", slots, ", got ", workspace.numel());
  at::Tensor out = gptq_host::bind(p, x, qweight, scales, zeros, bias, workspace);
  gptq_host::launch(v.kernel, ctas, gptq::kGemmBlock, v.smem, true, p, x_tensor_map(x, bt));
  return out;
}

}  // namespace

// Declared in bindings.cpp, which registers it as pagedq::gptq_gemm.
at::Tensor gptq_gemm_cuda(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& zeros,
                          const std::optional<at::Tensor>& bias, at::Tensor& workspace,
                          int64_t group_size, int64_t tile_tokens) {
  gptq_host::check_inputs("gptq_gemm", int64_t{1} << 30, x, qweight, scales, zeros, bias,
                          workspace, group_size);
  TORCH_CHECK(tile_tokens == 64 || tile_tokens == 128 || tile_tokens == 256,
              "gptq_gemm: tile_tokens = ", tile_tokens,
              ", the kernel has tiles of 64, 128 or 256 tokens");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const int sm = gptq_host::capability(x.device().index());
  TORCH_CHECK(sm == 90, "gptq_gemm: needs an sm_90 GPU (wgmma), device ", x.device(), " is sm_",
              sm);
  const int bt = static_cast<int>(tile_tokens);
  if (x.scalar_type() == at::kHalf) {
    return run<__half>(x, qweight, scales, zeros, bias, workspace, group_size, bt);
  }
  return run<__nv_bfloat16>(x, qweight, scales, zeros, bias, workspace, group_size, bt);
}

}  // namespace pagedq
