// CUDA host functions of rope_ and rope_backward: plan (every check, before any byte is
// written), then the kernel of csrc/kernels/rope/. No memory beyond the output: the forward
// writes over x, the backward into grad_x (and reads a contiguous copy of grad only where its
// rows are strided within or do not merge).
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/rope/rope.h"

namespace mti::cuda {
namespace {

void run(const RopePlan& plan, const at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
         bool backward) {
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (out.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(launch_rope(plan.in.const_data_ptr<double>(), out.data_ptr<double>(),
                               cos.const_data_ptr<double>(), sin.const_data_ptr<double>(),
                               plan.layout, backward, stream));
    return;
  }
  MTI_DISPATCH_FLOATING(out.scalar_type(), "rope_", [&] {
    C10_CUDA_CHECK(launch_rope(const_device_ptr<scalar_t>(plan.in), device_ptr<scalar_t>(out),
                               const_device_ptr<scalar_t>(cos), const_device_ptr<scalar_t>(sin),
                               plan.layout, backward, stream));
  });
}

}  // namespace

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  run(plan_rope(x, cos, sin), x, cos, sin, /*backward=*/false);
}

void rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& grad_x) {
  run(plan_rope_backward(grad, cos, sin, grad_x), grad_x, cos, sin, /*backward=*/true);
}

}  // namespace mti::cuda
