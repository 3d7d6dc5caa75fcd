// CPU backward passes of softmax_ / log_softmax_ and layer_norm_ / rms_norm_, computed from
// the forward's output y. grad_x comes from the vectorized row kernels (vec_kernels.h, picked
// by isa.h). grad_weight / grad_bias come from a second pass, parallel over blocks of columns,
// that sums each column over the rows in row order, in double: the same bits whatever the
// thread count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

// grad_weight[j] = sum over rows of dy * x_hat, grad_bias[j] = sum over rows of dy (either
// may be nullptr: not wanted), x_hat = (y - bias) / weight, 0 where weight is 0. Zeros when
// there are no rows. The weight and bias are read into double once per call (two rows).
template <typename scalar_t>
void norm_param_grads(const scalar_t* y, const scalar_t* dy, const BackwardRows& R,
                      const scalar_t* weight, const scalar_t* bias, scalar_t* grad_weight,
                      scalar_t* grad_bias) {
  constexpr int64_t kBlock = 64;  // columns per task: a cache line or more of each row
  const int64_t n = R.y.n, ys = R.y.col_stride, gs = R.grad.col_stride;
  std::vector<double> wd(n, 1.0), bd(n, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    if (weight) wd[j] = static_cast<double>(weight[j]);
    if (bias) bd[j] = static_cast<double>(bias[j]);
  }
  at::parallel_for(0, at::divup(n, kBlock), 1, [&](int64_t begin, int64_t end) {
    double acc_w[kBlock], acc_b[kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock, width = std::min(n, c0 + kBlock) - c0;
      const double* __restrict__ wb = wd.data() + c0;
      const double* __restrict__ bb = bd.data() + c0;
      std::fill(acc_w, acc_w + kBlock, 0.0);
      std::fill(acc_b, acc_b + kBlock, 0.0);
      for (int64_t r = 0; r < R.y.rows; ++r) {
        const scalar_t* yr = y + R.y.row.offset(r) + c0 * ys;
        const scalar_t* gr = dy + R.grad.row.offset(r) + c0 * gs;
        for (int64_t j = 0; j < width; ++j) {
          const double g = static_cast<double>(gr[j * gs]);
          const double xh = wb[j] != 0 ? (static_cast<double>(yr[j * ys]) - bb[j]) / wb[j] : 0.0;
          acc_b[j] += g;
          acc_w[j] += g * xh;
        }
      }
      for (int64_t j = 0; j < width; ++j) {
        if (grad_weight) grad_weight[c0 + j] = scalar_t(acc_w[j]);
        if (grad_bias) grad_bias[c0 + j] = scalar_t(acc_b[j]);
      }
    }
  });
}

}  // namespace

// y, grad, grad_x: same shape; softmax over `dim`.
void softmax_backward(const at::Tensor& y, const at::Tensor& grad, int64_t dim, double scale,
                      const std::optional<at::Tensor>& mask, bool causal, bool log,
                      const at::Tensor& grad_x) {
  const SoftmaxBackwardPlan plan =
      plan_softmax_backward("softmax_backward", y, grad, dim, scale, mask, causal, log, grad_x);
  if (plan.rows.y.rows == 0) return;
  MTI_CPU_DISPATCH(y.scalar_type(), "softmax_backward", [&] {
    const scalar_t* yp = plan.y.const_data_ptr<scalar_t>();
    const scalar_t* gp = plan.grad.const_data_ptr<scalar_t>();
    scalar_t* dx = grad_x.data_ptr<scalar_t>();
    switch (plan.mask.kind) {
      case MaskKind::kNone:
        MTI_CPU_ISA_CALL(softmax_backward_rows, yp, gp, dx, plan.rows,
                         static_cast<const scalar_t*>(nullptr), plan.mask, plan.params);
        break;
      case MaskKind::kBool:
        MTI_CPU_ISA_CALL(softmax_backward_rows, yp, gp, dx, plan.rows,
                         plan.mask_tensor.const_data_ptr<bool>(), plan.mask, plan.params);
        break;
      case MaskKind::kAdditive:
        MTI_CPU_ISA_CALL(softmax_backward_rows, yp, gp, dx, plan.rows,
                         plan.mask_tensor.const_data_ptr<scalar_t>(), plan.mask, plan.params);
        break;
    }
  });
}

// y, grad, grad_x: [..., *normalized_shape]; weight, bias, grad_weight, grad_bias:
// normalized_shape; rstd: [rows] float32.
void norm_backward(const at::Tensor& y, const at::Tensor& grad, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd, bool rms, const at::Tensor& grad_x,
                   const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  const NormBackwardPlan plan =
      plan_norm_backward("norm_backward", y, grad, normalized_shape, weight, bias, rstd, rms,
                         grad_x, grad_weight, grad_bias);
  MTI_CPU_DISPATCH(y.scalar_type(), "norm_backward", [&] {
    const scalar_t* yp = plan.y.const_data_ptr<scalar_t>();
    const scalar_t* gp = plan.grad.const_data_ptr<scalar_t>();
    const scalar_t* w = optional_data<scalar_t>(plan.weight);
    const scalar_t* b = optional_data<scalar_t>(plan.bias);
    if (plan.want_x && plan.rows.y.rows > 0)
      MTI_CPU_ISA_CALL(norm_backward_rows, yp, gp, grad_x.data_ptr<scalar_t>(), plan.rows, w, b,
                       rstd.const_data_ptr<float>(), plan.rms);
    if (plan.want_weight || plan.want_bias)
      norm_param_grads<scalar_t>(yp, gp, plan.rows, w, b,
                                 plan.want_weight ? grad_weight.data_ptr<scalar_t>() : nullptr,
                                 plan.want_bias ? grad_bias.data_ptr<scalar_t>() : nullptr);
  });
}

}  // namespace mti::cpu
