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

#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/square_matmul.h"

namespace mti::cuda {
namespace {

// x <- x @ Wv (+ bias) by the zero-workspace kernel. Raises before writing anything when K
// is beyond the kernel's shared memory; `why` says why no workspace is used.
template <typename scalar_t>
void run_zero_workspace(const at::Tensor& x, const MatmulPlan& plan, cudaStream_t stream,
                        const char* why) {
  using T = typename DeviceType<scalar_t>::type;
  int64_t max_k = 0;
  C10_CUDA_CHECK(square_matmul_zero_ws_max_k<T>(&max_k));
  TORCH_CHECK(plan.k <= max_k, "square_matmul_: K=", text(plan.k),
              " is too large for the zero-workspace kernel (max ", text(max_k), " for ",
              x.scalar_type(), " on this GPU), which is used because ", why,
              "; allow a workspace of at least one row (", text(plan.k * x.element_size()), " bytes)");
  C10_CUDA_CHECK(square_matmul_zero_ws<T>(
      device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight),
      plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr, plan.transpose, stream));
}

}  // namespace

void square_matmul_(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transpose,
                    int64_t workspace_bytes) {
  const MatmulPlan plan = plan_square_matmul(x, weight, bias, transpose, workspace_bytes);
  if (plan.x.rows == 0) return;  // also K == 0
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The dispatch also refuses float64 (which the plan accepts for the CPU's gradcheck) on
  // every path, before anything is written.
  MTI_DISPATCH_FLOATING(x.scalar_type(), "square_matmul_", [&] {
    if (const char* why = square_matmul_with_workspace(x, plan, workspace_bytes))
      run_zero_workspace<scalar_t>(x, plan, stream, why);
  });
}

}  // namespace mti::cuda
