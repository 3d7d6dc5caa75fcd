// CPU backward passes of softmax_ / log_softmax_ and layer_norm_ / rms_norm_, computed from
// the forward's output y: one row at a time, in double throughout (the CPU path is the
// accuracy reference; its gradients then carry little more than the error already in y).
// grad_weight / grad_bias come from a second pass, parallel over blocks of columns, that sums
// each column over the rows in row order: the same bits whatever the thread count.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

// dz = y * (dy - sum(dy * y) / sum(y)) (softmax) or dy - exp(y) * sum(dy) / sum(exp(y))
// (log_softmax), the sums over the whole row; grad_x = dz * scale, 0 where an element is masked
// (bool mask False, additive mask -inf, or past the causal limit). The divisions are by 1 but
// for rounding: the rounded probabilities of a stored output need not sum to 1 (a 16-bit y, or
// a log-probability's shared offset), and where the difference cancels, that error would
// dominate grad_x.
template <typename scalar_t, typename mask_t>
void softmax_backward_rows(const scalar_t* y, const scalar_t* dy, scalar_t* dx,
                           const BackwardRows& R, const mask_t* mask, const MaskLayout& ML,
                           const SoftmaxParams& p) {
  using acc_t = double;
  const int64_t n = R.y.n;
  at::parallel_for(0, R.y.rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* yr = y + R.y.row.offset(r);
      const scalar_t* gr = dy + R.grad.row.offset(r);
      scalar_t* xr = dx + R.grad_x.row.offset(r);
      const mask_t* mr = mask ? mask + ML.row.offset(r) : nullptr;
      const int64_t last_active = p.causal ? r % p.q_len : n - 1;  // causal: j <= i
      acc_t s = 0, sum_p = 0;
      for (int64_t j = 0; j < n; ++j) {
        const acc_t g = static_cast<acc_t>(gr[j * R.grad.col_stride]);
        const acc_t yv = static_cast<acc_t>(yr[j * R.y.col_stride]);
        s += p.log ? g : g * yv;
        sum_p += p.log ? std::exp(yv) : yv;
      }
      s = sum_p > 0 ? s / sum_p : 0;  // 0: no active element
      const acc_t scale = p.scale;
      for (int64_t j = 0; j < n; ++j) {
        bool active = j <= last_active;
        if (mr) {
          const mask_t m = mr[j * ML.col_stride];
          if constexpr (std::is_same_v<mask_t, bool>)
            active = active && m;
          else
            active = active && static_cast<acc_t>(m) != -std::numeric_limits<acc_t>::infinity();
        }
        acc_t out = 0;
        if (active) {
          const acc_t yv = static_cast<acc_t>(yr[j * R.y.col_stride]);
          const acc_t g = static_cast<acc_t>(gr[j * R.grad.col_stride]);
          out = (p.log ? g - std::exp(yv) * s : yv * (g - s)) * scale;
        }
        xr[j * R.grad_x.col_stride] = scalar_t(out);
      }
    }
  });
}

// The normalized input recovered from the output: (y - bias) / weight, 0 where weight is 0.
template <typename acc_t, typename scalar_t>
acc_t x_hat(acc_t y, const scalar_t* weight, const scalar_t* bias, int64_t j) {
  if (bias) y -= static_cast<acc_t>(bias[j]);
  if (!weight) return y;
  const acc_t w = static_cast<acc_t>(weight[j]);
  return w != 0 ? y / w : acc_t(0);
}

// grad_x = rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), g_hat = dy * weight;
// RMSNorm without the mean(g_hat) term.
template <typename scalar_t>
void norm_backward_rows(const scalar_t* y, const scalar_t* dy, scalar_t* dx, const BackwardRows& R,
                        const scalar_t* weight, const scalar_t* bias, const float* rstd, bool rms) {
  using acc_t = double;
  const int64_t n = R.y.n;
  at::parallel_for(0, R.y.rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xh(n), gh(n);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* yr = y + R.y.row.offset(r);
      const scalar_t* gr = dy + R.grad.row.offset(r);
      scalar_t* xr = dx + R.grad_x.row.offset(r);
      acc_t sum_g = 0, sum_gx = 0;
      for (int64_t j = 0; j < n; ++j) {
        xh[j] = x_hat(static_cast<acc_t>(yr[j * R.y.col_stride]), weight, bias, j);
        gh[j] = static_cast<acc_t>(gr[j * R.grad.col_stride]);
        if (weight) gh[j] *= static_cast<acc_t>(weight[j]);
        sum_g += gh[j];
        sum_gx += gh[j] * xh[j];
      }
      const acc_t mean_g = rms ? 0.0 : sum_g / static_cast<double>(n);
      const acc_t mean_gx = sum_gx / static_cast<double>(n);
      const acc_t rs = static_cast<acc_t>(rstd[r]);
      for (int64_t j = 0; j < n; ++j)
        xr[j * R.grad_x.col_stride] = scalar_t(rs * (gh[j] - mean_g - xh[j] * mean_gx));
    }
  });
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
        softmax_backward_rows<scalar_t, scalar_t>(yp, gp, dx, plan.rows, nullptr, plan.mask,
                                                  plan.params);
        break;
      case MaskKind::kBool:
        softmax_backward_rows<scalar_t, bool>(
            yp, gp, dx, plan.rows, plan.mask_tensor.const_data_ptr<bool>(), plan.mask, plan.params);
        break;
      case MaskKind::kAdditive:
        softmax_backward_rows<scalar_t, scalar_t>(yp, gp, dx, plan.rows,
                                                  plan.mask_tensor.const_data_ptr<scalar_t>(),
                                                  plan.mask, plan.params);
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
      norm_backward_rows<scalar_t>(yp, gp, grad_x.data_ptr<scalar_t>(), plan.rows, w, b,
                                   rstd.const_data_ptr<float>(), plan.rms);
    if (plan.want_weight || plan.want_bias)
      norm_param_grads<scalar_t>(yp, gp, plan.rows, w, b,
                                 plan.want_weight ? grad_weight.data_ptr<scalar_t>() : nullptr,
                                 plan.want_bias ? grad_bias.data_ptr<scalar_t>() : nullptr);
  });
}

}  // namespace mti::cpu
