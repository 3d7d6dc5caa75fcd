// CPU cross_entropy_: every target is checked (and the valid ones counted) before any row is
// written; then each row is read three times in place (max, sum of exps, write), with no
// buffer at all. Sums run in double, as in rowwise.cpp: the CPU path is the accuracy
// reference, not the fast one.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "common/checks.h"
#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

// The number of rows whose target is not ignore_index; raises on a target outside [0, n).
int64_t count_valid_targets(const int64_t* target, int64_t rows, int64_t n, int64_t ignore_index) {
  int64_t valid = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = target[r];
    if (t == ignore_index) continue;
    TORCH_CHECK_INDEX(t >= 0 && t < n, "cross_entropy_: target ", text(t), " (row ", text(r),
                      ") is out of bounds for ", text(n), " classes and is not ignore_index (",
                      text(ignore_index), ")");
    ++valid;
  }
  return valid;
}

template <typename scalar_t, typename loss_t>
void cross_entropy_rows(scalar_t* logits, const RowLayout& L, const int64_t* target,
                        const CrossEntropyParams& p, double scale, loss_t* losses) {
  using acc_t = at::opmath_type<scalar_t>;
  const double eps = p.label_smoothing;
  const acc_t off_target = static_cast<acc_t>(eps / static_cast<double>(L.n));
  const acc_t on_target = static_cast<acc_t>(1.0 - eps) + off_target;
  at::parallel_for(0, L.rows, grain_rows(L.n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = logits + L.row.offset(r);
      const int64_t t = target[r];
      if (t == p.ignore_index) {
        std::fill(row, row + L.n, scalar_t(0));
        // 0 / 0 = NaN where every row is ignored: the mean of no losses, as in PyTorch.
        losses[r] = static_cast<loss_t>(0.0 * scale);
        continue;
      }
      acc_t mx = -std::numeric_limits<acc_t>::infinity();
      double sum_x = 0;
      for (int64_t j = 0; j < L.n; ++j) {
        const acc_t v = static_cast<acc_t>(row[j]);
        mx = std::max(mx, v);
        sum_x += v;
      }
      double sum_exp = 0;
      for (int64_t j = 0; j < L.n; ++j) sum_exp += std::exp(static_cast<acc_t>(row[j]) - mx);
      const double lse = static_cast<double>(mx) + std::log(sum_exp);
      const double x_t = static_cast<double>(static_cast<acc_t>(row[t]));
      // eps == 0 drops the smoothing term whatever sum_x is (an infinite logit makes it NaN).
      const double smooth = eps > 0 ? eps * (lse - sum_x / static_cast<double>(L.n)) : 0.0;
      losses[r] = static_cast<loss_t>(((1.0 - eps) * (lse - x_t) + smooth) * scale);
      const acc_t inv = static_cast<acc_t>(1.0 / sum_exp);
      const acc_t s = static_cast<acc_t>(scale);
      for (int64_t j = 0; j < L.n; ++j) {
        const acc_t prob = std::exp(static_cast<acc_t>(row[j]) - mx) * inv;
        row[j] = scalar_t((prob - (j == t ? on_target : off_target)) * s);
      }
    }
  });
}

}  // namespace

void cross_entropy_(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                    int64_t reduction, double label_smoothing, const at::Tensor& losses) {
  const CrossEntropyPlan plan =
      plan_cross_entropy(logits, target, ignore_index, reduction, label_smoothing, losses);
  const RowLayout& L = plan.logits;
  const int64_t* t = plan.target.const_data_ptr<int64_t>();
  const int64_t valid = count_valid_targets(t, L.rows, L.n, ignore_index);
  if (L.rows == 0) return;
  const double scale = plan.params.reduction == CrossEntropyReduction::kMean
                           ? 1.0 / static_cast<double>(valid)
                           : 1.0;
  MTI_CPU_DISPATCH(logits.scalar_type(), "cross_entropy_", [&] {
    scalar_t* x = logits.data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, double>)
      cross_entropy_rows(x, L, t, plan.params, scale, losses.data_ptr<double>());
    else
      cross_entropy_rows(x, L, t, plan.params, scale, losses.data_ptr<float>());
  });
}

}  // namespace mti::cpu
