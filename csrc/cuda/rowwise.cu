// CUDA host functions of softmax_ / log_softmax_, layer_norm_ and rms_norm_: plan (all checks,
// before any byte of x is written), then dispatch on dtype and launch the torch-free kernels
// of csrc/kernels/rowwise/ (float64: their *_f64 launchers).
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/rowwise/rowwise.h"

namespace mti::cuda {
namespace {

// layer_norm_ / rms_norm_ of a float64 x; rstd (when plan.save_rstd) is float64 too.
cudaError_t norm_f64(const at::Tensor& x, const NormPlan& plan, double eps, bool rms,
                     const at::Tensor& rstd, cudaStream_t stream) {
  return launch_norm_f64(x.data_ptr<double>(), plan.x,
                         plan.weight.defined() ? plan.weight.data_ptr<double>() : nullptr,
                         plan.bias.defined() ? plan.bias.data_ptr<double>() : nullptr, eps, rms,
                         plan.save_rstd ? rstd.data_ptr<double>() : nullptr, stream);
}

}  // namespace

// x: any shape; softmax over `dim`, rows = every other index.
void softmax_(const at::Tensor& x, int64_t dim, double scale, const std::optional<at::Tensor>& mask,
              bool causal, bool log) {
  const SoftmaxPlan plan =
      plan_softmax(log ? "log_softmax_" : "softmax_", x, dim, scale, mask, causal, log);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const void* mask_data = plan.mask.kind == MaskKind::kNone ? nullptr : plan.mask_tensor.data_ptr();
  if (x.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(launch_softmax_f64(x.data_ptr<double>(), plan.x, mask_data, plan.mask,
                                      plan.params, scale, stream));
    return;
  }
  MTI_DISPATCH_FLOATING(x.scalar_type(), "softmax_", [&] {
    C10_CUDA_CHECK(
        launch_softmax(device_ptr<scalar_t>(x), plan.x, mask_data, plan.mask, plan.params, stream));
  });
}

// x: [..., *normalized_shape]; weight, bias: normalized_shape; rstd: empty or [rows] of
// rstd_dtype(x).
void layer_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                 double eps, const at::Tensor& rstd) {
  const NormPlan plan = plan_norm("layer_norm_", x, normalized_shape, weight, bias, rstd);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(norm_f64(x, plan, eps, /*rms=*/false, rstd, stream));
    return;
  }
  float* rstd_out = plan.save_rstd ? rstd.data_ptr<float>() : nullptr;
  MTI_DISPATCH_FLOATING(x.scalar_type(), "layer_norm_", [&] {
    const auto* w = plan.weight.defined() ? device_ptr<scalar_t>(plan.weight) : nullptr;
    const auto* b = plan.bias.defined() ? device_ptr<scalar_t>(plan.bias) : nullptr;
    C10_CUDA_CHECK(launch_layer_norm(device_ptr<scalar_t>(x), plan.x, w, b, static_cast<float>(eps),
                                     rstd_out, stream));
  });
}

// x: [..., *normalized_shape]; weight: normalized_shape; rstd: empty or [rows] of rstd_dtype(x).
void rms_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
               const std::optional<at::Tensor>& weight, double eps, const at::Tensor& rstd) {
  const NormPlan plan = plan_norm("rms_norm_", x, normalized_shape, weight, std::nullopt, rstd);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(norm_f64(x, plan, eps, /*rms=*/true, rstd, stream));
    return;
  }
  float* rstd_out = plan.save_rstd ? rstd.data_ptr<float>() : nullptr;
  MTI_DISPATCH_FLOATING(x.scalar_type(), "rms_norm_", [&] {
    const auto* w = plan.weight.defined() ? device_ptr<scalar_t>(plan.weight) : nullptr;
    C10_CUDA_CHECK(launch_rms_norm(device_ptr<scalar_t>(x), plan.x, w, static_cast<float>(eps),
                                   rstd_out, stream));
  });
}

}  // namespace mti::cuda
