// CPU backward passes of softmax_ / log_softmax_ and layer_norm_ / rms_norm_, computed from
// the forward's output y. grad_x comes from the vectorized row kernels (vec_kernels.h, picked
// by isa.h). grad_weight / grad_bias come from a second pass, parallel over blocks of columns,
// that sums each column over the rows in row order, in double: the same bits whatever the
// thread count.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

// The normalized input recovered from the output: (y - bias) / weight, 0 where weight is 0.
template <typename acc_t, typename scalar_t>
acc_t x_hat(acc_t y, const scalar_t* weight, const scalar_t* bias, int64_t j) {
  if (bias) y -= static_cast<acc_t>(bias[j]);
  if (!weight) return y;
  const acc_t w = static_cast<acc_t>(weight[j]);
  return w != 0 ? y / w : acc_t(0);
}

// grad_weight[j] = sum over rows of dy * x_hat, grad_bias[j] = sum over rows of dy (either
// may be nullptr: not wanted). Zeros when there are no rows.
template <typename scalar_t>
void norm_param_grads(const scalar_t* y, const scalar_t* dy, const BackwardRows& R,
                      const scalar_t* weight, const scalar_t* bias, scalar_t* grad_weight,
                      scalar_t* grad_bias) {
  using acc_t = double;
  constexpr int64_t kBlock = 64;  // columns per task: a cache line or more of each row
  at::parallel_for(0, at::divup(R.y.n, kBlock), 1, [&](int64_t begin, int64_t end) {
    double acc_w[kBlock], acc_b[kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock, c1 = std::min(R.y.n, c0 + kBlock);
      std::fill(acc_w, acc_w + kBlock, 0.0);
      std::fill(acc_b, acc_b + kBlock, 0.0);
      for (int64_t r = 0; r < R.y.rows; ++r) {
        const scalar_t* yr = y + R.y.row.offset(r);
        const scalar_t* gr = dy + R.grad.row.offset(r);
        for (int64_t j = c0; j < c1; ++j) {
          const acc_t g = static_cast<acc_t>(gr[j * R.grad.col_stride]);
          acc_b[j - c0] += g;
          if (grad_weight)
            acc_w[j - c0] += g * x_hat(static_cast<acc_t>(yr[j * R.y.col_stride]), weight, bias, j);
        }
      }
      for (int64_t j = c0; j < c1; ++j) {
        if (grad_weight) grad_weight[j] = scalar_t(acc_w[j - c0]);
        if (grad_bias) grad_bias[j] = scalar_t(acc_b[j - c0]);
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
