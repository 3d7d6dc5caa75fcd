// CUDA host functions of softmax_backward and norm_backward: plan (all checks, before any
// byte is written), then dispatch on dtype and launch the torch-free kernels of
// csrc/kernels/rowwise/ (float64: their *_f64 launchers).
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/rowwise/rowwise.h"

namespace mti::cuda {

// y, grad, grad_x: same shape; softmax over `dim`; mask broadcastable to y.
void softmax_backward(const at::Tensor& y, const at::Tensor& grad, int64_t dim, double scale,
                      const std::optional<at::Tensor>& mask, bool causal, bool log,
                      const at::Tensor& grad_x) {
  const SoftmaxBackwardPlan plan =
      plan_softmax_backward("softmax_backward", y, grad, dim, scale, mask, causal, log, grad_x);
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const void* mask_data = plan.mask.kind == MaskKind::kNone ? nullptr : plan.mask_tensor.data_ptr();
  if (y.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(launch_softmax_backward_f64(
        plan.y.data_ptr<double>(), plan.grad.data_ptr<double>(), grad_x.data_ptr<double>(),
        plan.rows, mask_data, plan.mask, plan.params, scale, stream));
    return;
  }
  MTI_DISPATCH_FLOATING(y.scalar_type(), "softmax_backward", [&] {
    C10_CUDA_CHECK(launch_softmax_backward(
        device_ptr<scalar_t>(plan.y), device_ptr<scalar_t>(plan.grad), device_ptr<scalar_t>(grad_x),
        plan.rows, mask_data, plan.mask, plan.params, stream));
  });
}

// y, grad, grad_x: [..., *normalized_shape]; weight, bias, grad_weight, grad_bias:
// normalized_shape (the gradients empty when not wanted); rstd: [rows] of rstd_dtype(y).
void norm_backward(const at::Tensor& y, const at::Tensor& grad, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd, bool rms, const at::Tensor& grad_x,
                   const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  const NormBackwardPlan plan =
      plan_norm_backward("norm_backward", y, grad, normalized_shape, weight, bias, rstd, rms,
                         grad_x, grad_weight, grad_bias);
  const c10::cuda::CUDAGuard guard(y.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (y.scalar_type() == at::kDouble) {
    const auto data = [](bool wanted, const at::Tensor& t) {
      return wanted ? t.data_ptr<double>() : nullptr;
    };
    C10_CUDA_CHECK(launch_norm_backward_f64(
        plan.y.data_ptr<double>(), plan.grad.data_ptr<double>(), data(plan.want_x, grad_x),
        plan.rows, data(plan.weight.defined(), plan.weight), data(plan.bias.defined(), plan.bias),
        rstd.data_ptr<double>(), plan.rms, data(plan.want_weight, grad_weight),
        data(plan.want_bias, grad_bias), stream));
    return;
  }
  MTI_DISPATCH_FLOATING(y.scalar_type(), "norm_backward", [&] {
    using T = typename DeviceType<scalar_t>::type;
    int64_t scratch_floats = 0;
    C10_CUDA_CHECK(
        norm_backward_scratch<T>(plan.rows, plan.want_weight, plan.want_bias, &scratch_floats));
    // From the caching allocator, like any tensor: it counts in the peak statistics.
    const at::Tensor scratch = at::empty({scratch_floats}, y.options().dtype(at::kFloat));
    C10_CUDA_CHECK(launch_norm_backward<T>(
        device_ptr<scalar_t>(plan.y), device_ptr<scalar_t>(plan.grad),
        plan.want_x ? device_ptr<scalar_t>(grad_x) : nullptr, plan.rows,
        plan.weight.defined() ? device_ptr<scalar_t>(plan.weight) : nullptr,
        plan.bias.defined() ? device_ptr<scalar_t>(plan.bias) : nullptr, rstd.data_ptr<float>(),
        plan.rms, plan.want_weight ? device_ptr<scalar_t>(grad_weight) : nullptr,
        plan.want_bias ? device_ptr<scalar_t>(grad_bias) : nullptr,
        scratch_floats > 0 ? scratch.data_ptr<float>() : nullptr, scratch_floats, stream));
  });
}

}  // namespace mti::cuda
