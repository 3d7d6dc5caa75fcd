// CUDA host side of square_matmul_: x[..., K] <- x @ W (or x @ W^T) + bias, over x.
//
// Default: cuBLAS through ATen, a chunk of rows at a time into a workspace of at most
// workspace_bytes, then copied back over those rows. With no room for one row, or when the
// workspace cannot be allocated, the zero-workspace kernel of kernels/square_matmul.cu.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/square_matmul.h"

namespace mti::cuda {
namespace {

// x <- x @ Wv (+ bias) by the zero-workspace kernel. Raises before writing anything when K
// is beyond the kernel's shared memory; `why` says why no workspace is used.
template <typename scalar_t>
void run_zero_workspace(const at::Tensor& x, const MatmulPlan& plan, bool transpose,
                        cudaStream_t stream, const char* why) {
  using T = typename DeviceType<scalar_t>::type;
  int64_t max_k = 0;
  C10_CUDA_CHECK(square_matmul_zero_ws_max_k<T>(&max_k));
  TORCH_CHECK(plan.k <= max_k, "square_matmul_: K=", plan.k,
              " is too large for the zero-workspace kernel (max ", max_k, " for ",
              x.scalar_type(), " on this GPU), which is used because ", why,
              "; allow a workspace of at least one row (", plan.k * x.element_size(), " bytes)");
  C10_CUDA_CHECK(square_matmul_zero_ws<T>(
      device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight),
      plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr, transpose, stream));
}

template <typename scalar_t>
void run(const at::Tensor& x, const MatmulPlan& plan, bool transpose, int64_t workspace_bytes,
         cudaStream_t stream) {
  const int64_t rows = plan.x.rows, k = plan.k;
  if (rows == 0) return;  // also K == 0

  // Rows per GEMM: as many as the workspace holds. One allocation per call, from the caching
  // allocator (so it counts in torch.cuda.max_memory_allocated).
  const int64_t chunk = std::min(rows, workspace_bytes / (k * x.element_size()));
  if (chunk < 1) {
    run_zero_workspace<scalar_t>(x, plan, transpose, stream,
                                 "workspace_bytes is smaller than one row");
    return;
  }
  at::Tensor ws;
  try {
    ws = at::empty({chunk, k}, x.options());
  } catch (const c10::OutOfMemoryError&) {
    // Nothing is written yet, so falling back leaves no partial result behind.
    run_zero_workspace<scalar_t>(x, plan, transpose, stream,
                                 "the workspace could not be allocated");
    return;
  }

  const at::Tensor wv = transpose ? plan.weight.t() : plan.weight;
  // [rows_i, K] blocks of x with leading dimension ld; each chunk: ws[:r] = x_chunk @ Wv
  // (+ bias, as addmm's 1-D self: cuBLASLt's bias epilogue), then x_chunk = ws[:r].
  for_each_matrix(plan.x, [&](int64_t offset, int64_t block_rows, int64_t ld) {
    for (int64_t r0 = 0; r0 < block_rows; r0 += chunk) {
      const int64_t r = std::min(chunk, block_rows - r0);
      const at::Tensor xc = x.as_strided({r, k}, {ld, 1}, x.storage_offset() + offset + r0 * ld);
      at::Tensor out = ws.narrow(0, 0, r);
      if (plan.bias)
        at::addmm_out(out, *plan.bias, xc, wv);
      else
        at::mm_out(out, xc, wv);
      xc.copy_(out);
    }
  });
}

}  // namespace

void square_matmul_(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transpose,
                    int64_t workspace_bytes) {
  TORCH_CHECK_VALUE(workspace_bytes >= 0, "square_matmul_: workspace_bytes must be >= 0, got ",
                    workspace_bytes);
  const MatmulPlan plan = plan_square_matmul(x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The dispatch also refuses float64 (which the plan accepts for the CPU's gradcheck) on
  // every path, before anything is written.
  MTI_DISPATCH_FLOATING(x.scalar_type(), "square_matmul_", [&] {
    run<scalar_t>(x, plan, transpose, workspace_bytes, stream);
  });
}

}  // namespace mti::cuda
