// CPU softmax_ / log_softmax_ / layer_norm_ / rms_norm_: the entry points, which check and
// plan (common/plans.h) before anything is written, then run the vectorized row kernels of
// vec_kernels.h for this CPU (isa.h).
#include <ATen/Dispatch.h>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

void norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
          double eps, const at::Tensor& rstd, bool rms) {
  const NormPlan plan = plan_norm(op, x, normalized_shape, weight, bias, rstd);
  if (plan.x.rows == 0) return;
  MTI_CPU_DISPATCH(x.scalar_type(), "norm_", [&] {
    MTI_CPU_ISA_CALL(norm_rows, x.data_ptr<scalar_t>(), plan.x,
                     optional_data<scalar_t>(plan.weight), optional_data<scalar_t>(plan.bias), eps,
                     plan.save_rstd ? rstd.data_ptr<float>() : nullptr, rms);
  });
}

}  // namespace

void softmax_(const at::Tensor& x, int64_t dim, double scale, const std::optional<at::Tensor>& mask,
              bool causal, bool log) {
  const char* op = log ? "log_softmax_" : "softmax_";
  const SoftmaxPlan plan = plan_softmax(op, x, dim, scale, mask, causal, log);
  if (plan.x.rows == 0) return;
  MTI_CPU_DISPATCH(x.scalar_type(), "softmax_", [&] {
    scalar_t* data = x.data_ptr<scalar_t>();
    switch (plan.mask.kind) {
      case MaskKind::kNone:
        MTI_CPU_ISA_CALL(softmax_rows, data, plan.x, static_cast<const scalar_t*>(nullptr),
                         plan.mask, plan.params);
        break;
      case MaskKind::kBool:
        MTI_CPU_ISA_CALL(softmax_rows, data, plan.x, plan.mask_tensor.const_data_ptr<bool>(),
                         plan.mask, plan.params);
        break;
      case MaskKind::kAdditive:
        MTI_CPU_ISA_CALL(softmax_rows, data, plan.x, plan.mask_tensor.const_data_ptr<scalar_t>(),
                         plan.mask, plan.params);
        break;
    }
  });
}

void layer_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                 double eps, const at::Tensor& rstd) {
  norm("layer_norm_", x, normalized_shape, weight, bias, eps, rstd, /*rms=*/false);
}

void rms_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
               const std::optional<at::Tensor>& weight, double eps, const at::Tensor& rstd) {
  norm("rms_norm_", x, normalized_shape, weight, std::nullopt, eps, rstd, /*rms=*/true);
}

}  // namespace mti::cpu
