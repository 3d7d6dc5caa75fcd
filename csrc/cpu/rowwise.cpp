// CPU softmax_ / log_softmax_ / layer_norm_ / rms_norm_: one row at a time, each row read into
// an opmath (fp32, or fp64 for double) buffer, reduced, and written back over itself. Extra
// memory is one row's buffer per thread. The row sums run in double: sequential fp32 sums err
// far more than PyTorch's vectorized ones, increasingly so on long rows, and the CPU path is
// the accuracy reference, not the fast one.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

template <typename scalar_t, typename mask_t>
void softmax_rows(scalar_t* x, const RowLayout& L, const mask_t* mask, const MaskLayout& ML,
                  const SoftmaxParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, L.rows, grain_rows(L.n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> z(L.n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x + L.row.offset(r);
      const mask_t* mrow = mask ? mask + ML.row.offset(r) : nullptr;
      const int64_t last_active = p.causal ? r % p.q_len : L.n - 1;  // causal: j <= i
      acc_t mx = kNegInf;
      for (int64_t j = 0; j < L.n; ++j) {
        acc_t v = static_cast<acc_t>(row[j * L.col_stride]) * static_cast<acc_t>(p.scale);
        if (mrow) {
          const mask_t m = mrow[j * ML.col_stride];
          if constexpr (std::is_same_v<mask_t, bool>) {
            if (!m) v = kNegInf;
          } else {
            v += static_cast<acc_t>(m);
          }
        }
        if (j > last_active) v = kNegInf;
        z[j] = v;
        mx = std::max(mx, v);
      }
      if (mx == kNegInf) {  // nothing takes part: the row becomes zeros (documented)
        for (int64_t j = 0; j < L.n; ++j) row[j * L.col_stride] = scalar_t(0);
        continue;
      }
      // softmax keeps each exp in z, so the write pass multiplies instead of exponentiating
      // again; log_softmax needs z itself.
      double sum = 0;
      for (int64_t j = 0; j < L.n; ++j) {
        const acc_t e = std::exp(z[j] - mx);
        sum += e;
        if (!p.log) z[j] = e;
      }
      if (p.log) {
        const acc_t shift = static_cast<acc_t>(mx + std::log(sum));
        for (int64_t j = 0; j < L.n; ++j) row[j * L.col_stride] = scalar_t(z[j] - shift);
      } else {
        const acc_t inv = static_cast<acc_t>(1.0 / sum);
        for (int64_t j = 0; j < L.n; ++j) row[j * L.col_stride] = scalar_t(z[j] * inv);
      }
    }
  });
}

// LayerNorm (rms = false) or RMSNorm (rms = true) of every row.
template <typename scalar_t>
void norm_rows(scalar_t* x, const RowLayout& L, const scalar_t* weight, const scalar_t* bias,
               double eps, float* rstd_out, bool rms) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, L.rows, grain_rows(L.n), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> v(L.n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x + L.row.offset(r);
      // Two passes over the buffered row: the mean first, then centred squares, which keeps
      // the variance accurate when |mean| >> std.
      double sum = 0;
      for (int64_t j = 0; j < L.n; ++j) {
        v[j] = static_cast<acc_t>(row[j * L.col_stride]);
        sum += v[j];
      }
      const double mean_d = rms ? 0.0 : sum / static_cast<double>(L.n);
      double sq = 0;
      for (int64_t j = 0; j < L.n; ++j) sq += (v[j] - mean_d) * (v[j] - mean_d);
      const double rstd_d = 1.0 / std::sqrt(sq / static_cast<double>(L.n) + eps);
      if (rstd_out) rstd_out[r] = static_cast<float>(rstd_d);
      // Outputs in double as well, rounded once: with the mean rounded to fp32 first, a row far
      // from 0 relative to its spread would lose the mean's rounding error times rstd.
      for (int64_t j = 0; j < L.n; ++j) {
        double y = (static_cast<double>(v[j]) - mean_d) * rstd_d;
        if (weight) y *= static_cast<double>(weight[j]);
        if (bias) y += static_cast<double>(bias[j]);
        row[j * L.col_stride] = scalar_t(static_cast<acc_t>(y));
      }
    }
  });
}

void norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
          const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
          double eps, const at::Tensor& rstd, bool rms) {
  const NormPlan plan = plan_norm(op, x, normalized_shape, weight, bias, rstd);
  if (plan.x.rows == 0) return;
  MTI_CPU_DISPATCH(x.scalar_type(), "norm_", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), plan.x, optional_data<scalar_t>(plan.weight),
                        optional_data<scalar_t>(plan.bias), eps,
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
        softmax_rows<scalar_t, scalar_t>(data, plan.x, nullptr, plan.mask, plan.params);
        break;
      case MaskKind::kBool:
        softmax_rows<scalar_t, bool>(data, plan.x, plan.mask_tensor.const_data_ptr<bool>(),
                                     plan.mask, plan.params);
        break;
      case MaskKind::kAdditive:
        softmax_rows<scalar_t, scalar_t>(data, plan.x, plan.mask_tensor.const_data_ptr<scalar_t>(),
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
