// CUDA host function of silu_mul_backward_: every check before any byte is written, then the
// kernel of csrc/kernels/silu_mul/. No memory beyond the inputs: both gradients go over them.
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/silu_mul/silu_mul.h"

namespace mti::cuda {

void silu_mul_backward_(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul_backward(grad, gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = gate.numel();
  if (gate.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(launch_silu_mul_backward(grad.const_data_ptr<double>(), gate.data_ptr<double>(),
                                            up.data_ptr<double>(), n, stream));
    return;
  }
  MTI_DISPATCH_FLOATING(gate.scalar_type(), "silu_mul_backward_", [&] {
    C10_CUDA_CHECK(launch_silu_mul_backward(const_device_ptr<scalar_t>(grad),
                                            device_ptr<scalar_t>(gate), device_ptr<scalar_t>(up), n,
                                            stream));
  });
}

}  // namespace mti::cuda
