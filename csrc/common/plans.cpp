#include "common/plans.h"

#include <ATen/WrapDimUtils.h>

#include <c10/util/accumulate.h>

#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "common/checks.h"

namespace mti {
namespace {

// Fills `index` with the leading dims [0, lead) of t, merging neighbours wherever the strides
// allow it and dropping size-1 dims. Returns false, having filled nothing, when more than
// kMaxLeadDims groups remain. Each tensor an op touches is indexed on its own: a tensor
// whose dims merge into one needs no division per row, whatever the others' layouts.
bool try_row_index(int64_t lead, const at::Tensor& t, RowIndexer& index) {
  std::vector<int64_t> sizes, strides;  // innermost first while building
  for (int64_t d = lead - 1; d >= 0; --d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (!sizes.empty() && stride == strides.back() * sizes.back()) {
      sizes.back() *= size;
      continue;
    }
    sizes.push_back(size);
    strides.push_back(stride);
  }
  if (static_cast<int>(sizes.size()) > kMaxLeadDims) return false;
  std::reverse(sizes.begin(), sizes.end());
  std::reverse(strides.begin(), strides.end());
  index.ndim = static_cast<int>(sizes.size());
  std::copy(sizes.begin(), sizes.end(), index.sizes);
  std::copy(strides.begin(), strides.end(), index.strides);
  return true;
}

// try_row_index for a tensor an op writes (or reads along with one), refusing layouts that do
// not merge.
void build_row_index(const char* op, const char* name, int64_t lead, const at::Tensor& t,
                     RowIndexer& index) {
  TORCH_CHECK_VALUE(try_row_index(lead, t, index), op, ": ", name,
                    "'s leading dims merge into more than ", text(kMaxLeadDims),
                    " strided groups; pass ", name, ".contiguous()");
}

// A tensor whose rows are read or written whole (x, grad, grad_x; `name`): stride 1 within
// a row.
void check_unit_stride(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    "'s last dim must have stride 1 (rows may be strided), got stride ",
                    text(t.stride(-1)), "; pass ", name, ".contiguous()");
}

}  // namespace

MatmulPlan plan_square_matmul(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool transpose,
                              int64_t workspace_bytes) {
  const char* op = "square_matmul_";
  TORCH_CHECK_VALUE(workspace_bytes >= 0, op, ": workspace_bytes must be >= 0, got ",
                    text(workspace_bytes));
  check_float_dtype(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim, got a scalar");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == weight.size(1), op,
              ": weight must be square, got ", text(weight.sizes()));
  check_like_x(op, "weight", x, weight);
  const int64_t k = weight.size(0);
  TORCH_CHECK(x.size(-1) == k, op, ": x's last dim (", text(x.size(-1)),
              ") must equal weight's size (", text(k), ")");
  if (bias) {
    check_like_x(op, "bias", x, *bias);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == k, op, ": bias must have shape (", text(k),
                ",), got ", text(bias->sizes()));
  }
  check_no_internal_overlap(op, x);
  check_no_overlap(op, "weight", x, weight);
  if (bias) check_no_overlap(op, "bias", x, *bias);
  check_unit_stride(op, "x", x);

  MatmulPlan plan;
  plan.k = k;
  plan.x.n = k;
  plan.x.rows = k == 0 ? 0 : x.numel() / k;
  plan.x.col_stride = 1;
  build_row_index(op, "x", x.dim() - 1, x, plan.x.row);
  // A column-major weight (e.g. W.T of a contiguous W) is the transpose of a contiguous one:
  // flip the flag rather than copy K x K elements.
  plan.transpose = transpose;
  if (!weight.is_contiguous() && weight.t().is_contiguous()) {
    plan.weight = weight.t();
    plan.transpose = !transpose;
  } else {
    plan.weight = weight.contiguous();
  }
  if (bias) plan.bias = bias->contiguous();
  return plan;
}

namespace {

// t with dim moved last: the softmax's rows. A 0-dim t is one row of one element.
at::Tensor softmax_rows_view(const at::Tensor& t, int64_t dim) {
  return t.dim() == 0 ? t.view({1}) : t.movedim(dim, -1);
}

// What softmax_ and its backward share, for x (the forward's input, the backward's y, called
// `x_name`): wraps dim, checks causal, fills params and mask_layout's kind and col_stride, and
// returns the mask expanded to x's shape with dim moved last (undefined without a mask). The
// caller checks that the mask does not overlap what it writes.
at::Tensor plan_softmax_common(const char* op, const at::Tensor& x, const char* x_name,
                               int64_t& dim, double scale, const std::optional<at::Tensor>& mask,
                               bool causal, bool log, SoftmaxParams& params,
                               MaskLayout& mask_layout) {
  check_float_dtype(op, x_name, x);
  const int64_t ndim = x.dim();
  dim = at::maybe_wrap_dim(dim, std::max<int64_t>(ndim, 1));
  TORCH_CHECK_VALUE(!causal || (ndim >= 2 && dim == ndim - 1), op, ": causal=True needs ", x_name,
                    " with at least 2 dims and dim=-1 (the mask covers the last two "
                    "dims), got ",
                    x_name, " of ", text(ndim), " dims and dim=", text(dim));
  params.scale = static_cast<float>(scale);
  params.log = log;
  params.causal = causal;
  params.q_len = causal ? x.size(-2) : 1;
  if (!mask) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.device() == x.device(), op, ": mask must be on ", x_name, "'s device (", x.device(),
              "), got ", m.device());
  TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == x.scalar_type(), op,
              ": mask must be bool or ", x_name, "'s dtype (", x.scalar_type(), "), got ",
              m.scalar_type());
  TORCH_CHECK(at::is_expandable_to(m.sizes(), x.sizes()), op, ": mask of shape ", text(m.sizes()),
              " does not broadcast to ", x_name, "'s shape ", text(x.sizes()));
  const at::Tensor me = ndim == 0 ? m.reshape({1}) : m.expand(x.sizes()).movedim(dim, -1);
  mask_layout.kind = m.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  mask_layout.col_stride = me.stride(-1);
  return me;
}

// Whether the trailing k dims of t merge into one strided dim (normalized element i at
// i * col_stride); *col_stride receives that stride (1 when they hold at most one element).
bool trailing_stride(const at::Tensor& t, int64_t k, int64_t* col_stride) {
  int64_t n = 1;
  bool found = false;
  *col_stride = 1;
  for (int64_t d = t.dim() - 1; d >= t.dim() - k; --d) {
    if (t.size(d) > 1) {
      if (!found) *col_stride = t.stride(d);
      found = true;
      if (t.stride(d) != *col_stride * n) return false;
    }
    n *= t.size(d);
  }
  return true;
}

void check_normalized_shape(const char* op, const char* x_name, const at::Tensor& x,
                            at::IntArrayRef normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1 && k <= x.dim() && x.sizes().slice(x.dim() - k).equals(normalized_shape), op,
              ": normalized_shape ", text(normalized_shape),
              " must be non-empty and equal the trailing dims of ", x_name, ", got ", x_name,
              " of shape ", text(x.sizes()));
}

// Checks a backward pass's grad (read) and grad_x (written, or empty when `grad_x_optional`)
// against y: same shape, dtype and device; grad_x is written element by element and must
// share memory with neither y nor grad.
void check_backward_tensors(const char* op, const at::Tensor& y, const at::Tensor& grad,
                            const at::Tensor& grad_x, bool grad_x_optional) {
  check_like(op, "grad", grad, "y", y);
  TORCH_CHECK(grad.sizes().equals(y.sizes()), op, ": grad must have y's shape ", text(y.sizes()),
              ", got ", text(grad.sizes()));
  if (grad_x_optional && !grad_x.defined()) return;
  TORCH_CHECK(grad_x.defined(), op, ": grad_x must be a tensor of y's shape");
  check_like(op, "grad_x", grad_x, "y", y);
  TORCH_CHECK(grad_x.sizes().equals(y.sizes()), op, ": grad_x must have y's shape ",
              text(y.sizes()), ", got ", text(grad_x.sizes()));
  check_no_internal_overlap(op, grad_x, "grad_x");
  check_no_overlap(op, "y", grad_x, y, "grad_x");
  check_no_overlap(op, "grad", grad_x, grad, "grad_x");
}

// The leading-dim indexes of a backward pass's tensors (rows views: leading dims, then the
// row), each on its own. y or grad whose leading dims do not merge into kMaxLeadDims groups is
// read from a contiguous copy instead (the plan keeps it alive); grad_x, which is written, and
// the mask must merge as they are.
void build_backward_index(const char* op, int64_t lead, at::Tensor& yv, at::Tensor& gv,
                          const at::Tensor* dxv, const at::Tensor* mv, BackwardRows& rows,
                          RowIndexer* mask_row) {
  const auto read_index = [&](const char* name, at::Tensor& t, RowIndexer& index) {
    if (try_row_index(lead, t, index)) return;
    t = t.contiguous();
    build_row_index(op, name, lead, t, index);
  };
  read_index("y", yv, rows.y.row);
  read_index("grad", gv, rows.grad.row);
  if (dxv) build_row_index(op, "grad_x", lead, *dxv, rows.grad_x.row);
  if (mv) build_row_index(op, "mask", lead, *mv, *mask_row);
}

// rstd: `rows` contiguous elements of rstd_dtype(x) on x's device (x called `x_name`).
void check_rstd(const char* op, const at::Tensor& rstd, const at::Tensor& x, const char* x_name,
                int64_t rows) {
  const at::ScalarType dtype = rstd_dtype(x);
  TORCH_CHECK(rstd.scalar_type() == dtype && rstd.is_contiguous() && rstd.numel() == rows &&
                  rstd.device() == x.device(),
              op, ": rstd must be a contiguous ", dtype, " tensor of ", text(rows), " elements on ",
              x_name, "'s device, got ", rstd.scalar_type(), " of ", text(rstd.numel()), " on ",
              rstd.device());
}

void set_rows(RowLayout& layout, int64_t rows, int64_t n, int64_t col_stride) {
  layout.rows = rows;
  layout.n = n;
  layout.col_stride = col_stride;
}

}  // namespace

at::ScalarType rstd_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble && x.is_cuda() ? at::kDouble : at::kFloat;
}

SoftmaxPlan plan_softmax(const char* op, const at::Tensor& x, int64_t dim, double scale,
                         const std::optional<at::Tensor>& mask, bool causal, bool log) {
  SoftmaxPlan plan;
  const at::Tensor mv =
      plan_softmax_common(op, x, "x", dim, scale, mask, causal, log, plan.params, plan.mask);
  check_no_internal_overlap(op, x);
  if (mask) check_no_overlap(op, "mask", x, *mask);
  plan.mask_tensor = mv;
  const at::Tensor xv = softmax_rows_view(x, dim);
  plan.x.n = xv.size(-1);
  plan.x.rows = plan.x.n == 0 ? 0 : xv.numel() / plan.x.n;
  plan.x.col_stride = xv.stride(-1);
  build_row_index(op, "x", xv.dim() - 1, xv, plan.x.row);
  if (mask) build_row_index(op, "mask", xv.dim() - 1, mv, plan.mask.row);
  return plan;
}

SoftmaxBackwardPlan plan_softmax_backward(const char* op, const at::Tensor& y,
                                          const at::Tensor& grad, int64_t dim, double scale,
                                          const std::optional<at::Tensor>& mask, bool causal,
                                          bool log, const at::Tensor& grad_x) {
  SoftmaxBackwardPlan plan;
  const at::Tensor mv =
      plan_softmax_common(op, y, "y", dim, scale, mask, causal, log, plan.params, plan.mask);
  check_backward_tensors(op, y, grad, grad_x, /*grad_x_optional=*/false);
  if (mask) check_no_overlap(op, "mask", grad_x, *mask, "grad_x");
  plan.mask_tensor = mv;
  at::Tensor yv = softmax_rows_view(y, dim), gv = softmax_rows_view(grad, dim);
  const at::Tensor dxv = softmax_rows_view(grad_x, dim);
  build_backward_index(op, yv.dim() - 1, yv, gv, &dxv, mask ? &mv : nullptr, plan.rows,
                       &plan.mask.row);
  plan.y = yv;
  plan.grad = gv;
  const int64_t n = yv.size(-1), rows = n == 0 ? 0 : yv.numel() / n;
  set_rows(plan.rows.y, rows, n, yv.stride(-1));
  set_rows(plan.rows.grad, rows, n, gv.stride(-1));
  set_rows(plan.rows.grad_x, rows, n, dxv.stride(-1));
  return plan;
}

NormPlan plan_norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd) {
  check_float_dtype(op, "x", x);
  check_normalized_shape(op, "x", x, normalized_shape);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  for (const auto* t : {&weight, &bias}) {
    if (!*t) continue;
    const char* name = t == &weight ? "weight" : "bias";
    check_like_x(op, name, x, **t);
    TORCH_CHECK((*t)->sizes().equals(normalized_shape), op, ": ", name, " must have shape ",
                text(normalized_shape), ", got ", text((*t)->sizes()));
    check_no_overlap(op, name, x, **t);
  }
  check_no_internal_overlap(op, x);
  NormPlan plan;
  TORCH_CHECK_VALUE(trailing_stride(x, k, &plan.x.col_stride), op,
                    ": the normalized dims of x must merge into one (as in a contiguous "
                    "tensor), got strides ",
                    text(x.strides()), "; pass x.contiguous()");
  plan.x.n = c10::multiply_integers(normalized_shape);
  plan.x.rows = plan.x.n == 0 ? 0 : x.numel() / plan.x.n;
  build_row_index(op, "x", x.dim() - k, x, plan.x.row);
  if (weight) plan.weight = weight->contiguous();
  if (bias) plan.bias = bias->contiguous();
  if (rstd.numel() > 0) {
    check_rstd(op, rstd, x, "x", plan.x.rows);
    check_no_overlap(op, "rstd", x, rstd);
    plan.save_rstd = true;
  }
  return plan;
}

NormBackwardPlan plan_norm_backward(const char* op, const at::Tensor& y, const at::Tensor& grad,
                                    at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& rstd,
                                    bool rms, const at::Tensor& grad_x,
                                    const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  check_float_dtype(op, "y", y);
  check_normalized_shape(op, "y", y, normalized_shape);
  TORCH_CHECK_VALUE(!(rms && bias), op, ": rms=True takes no bias");
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  const int64_t n = c10::multiply_integers(normalized_shape);
  const int64_t rows = n == 0 ? 0 : y.numel() / n;
  // An out argument with no elements is not wanted (or has nothing to receive).
  const bool want_x = grad_x.numel() > 0;
  check_backward_tensors(op, y, grad, want_x ? grad_x : at::Tensor(), /*grad_x_optional=*/true);
  check_rstd(op, rstd, y, "y", rows);
  // Every tensor the op writes, with the name its messages use; each is checked against all
  // that is read, and against the ones written before it.
  std::vector<std::pair<const char*, at::Tensor>> read{{"y", y}, {"grad", grad}, {"rstd", rstd}};
  std::vector<std::pair<const char*, at::Tensor>> written;
  if (want_x) written.emplace_back("grad_x", grad_x);
  NormBackwardPlan plan;
  for (const auto* t : {&weight, &bias}) {
    if (!*t) continue;
    const char* name = t == &weight ? "weight" : "bias";
    check_like(op, name, **t, "y", y);
    TORCH_CHECK((*t)->sizes().equals(normalized_shape), op, ": ", name, " must have shape ",
                text(normalized_shape), ", got ", text((*t)->sizes()));
    read.emplace_back(name, **t);
  }
  for (const auto* out : {&grad_weight, &grad_bias}) {
    if (out->numel() == 0) continue;
    const bool is_w = out == &grad_weight;
    const char* name = is_w ? "grad_weight" : "grad_bias";
    const std::optional<at::Tensor>& param = is_w ? weight : bias;
    TORCH_CHECK(param.has_value(), op, ": ", name, " is given but ", is_w ? "weight" : "bias",
                " is None");
    check_like(op, name, *out, is_w ? "weight" : "bias", *param);
    TORCH_CHECK(out->sizes().equals(param->sizes()) && out->is_contiguous(), op, ": ", name,
                " must be a contiguous tensor of shape ", text(param->sizes()), ", got ",
                text(out->sizes()), out->is_contiguous() ? "" : " (not contiguous)");
    written.emplace_back(name, *out);
    (is_w ? plan.want_weight : plan.want_bias) = true;
  }
  for (size_t i = 0; i < written.size(); ++i) {
    for (const auto& [name, t] : read)
      check_no_overlap(op, name, written[i].second, t, written[i].first);
    for (size_t j = 0; j < i; ++j)
      check_no_overlap(op, written[j].first, written[i].second, written[j].second,
                       written[i].first);
  }

  int64_t y_col = 1, g_col = 1, dx_col = 1;
  TORCH_CHECK_VALUE(trailing_stride(y, k, &y_col), op,
                    ": the normalized dims of y must merge into one (as in a contiguous "
                    "tensor), got strides ",
                    text(y.strides()));
  TORCH_CHECK_VALUE(!want_x || trailing_stride(grad_x, k, &dx_col), op,
                    ": the normalized dims of grad_x must merge into one (as in a contiguous "
                    "tensor), got strides ",
                    text(grad_x.strides()));
  // grad comes from autograd in any layout (an expanded one from .sum(), say): read a
  // contiguous copy where its normalized dims do not merge.
  plan.grad = trailing_stride(grad, k, &g_col) ? grad : grad.contiguous();
  plan.y = y;
  build_backward_index(op, y.dim() - k, plan.y, plan.grad, want_x ? &grad_x : nullptr, nullptr,
                       plan.rows, nullptr);
  // build_backward_index may have replaced y and grad by contiguous copies.
  trailing_stride(plan.y, k, &y_col);
  trailing_stride(plan.grad, k, &g_col);
  set_rows(plan.rows.y, rows, n, y_col);
  set_rows(plan.rows.grad, rows, n, g_col);
  set_rows(plan.rows.grad_x, rows, n, dx_col);
  plan.want_x = want_x;
  plan.rms = rms;
  if (weight) plan.weight = weight->contiguous();
  if (bias) plan.bias = bias->contiguous();
  return plan;
}

CrossEntropyPlan plan_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                    int64_t ignore_index, int64_t reduction, double label_smoothing,
                                    const at::Tensor& losses) {
  const char* op = "cross_entropy_";
  check_float_dtype(op, "logits", logits);
  TORCH_CHECK(logits.dim() >= 1, op, ": logits must have a class dim, got a scalar");
  TORCH_CHECK(target.scalar_type() == at::kLong, op,
              ": target must hold int64 class indices (class probabilities are not supported), "
              "got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), op, ": target must be on logits' device (",
              logits.device(), "), got ", target.device());
  const at::IntArrayRef lead = logits.sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK(target.sizes().equals(lead), op, ": target must have logits' shape without its ",
              "last (class) dim, ", text(lead), ", got ", text(target.sizes()));
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, op,
                    ": reduction must be 0 (none), 1 (mean) or 2 (sum), got ", text(reduction));
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be between 0.0 and 1.0, got ",
              std::to_string(label_smoothing));
  const int64_t n = logits.size(-1);
  const int64_t rows = target.numel();
  TORCH_CHECK(n > 0 || rows == 0, op, ": logits' class dim must not be empty");
  TORCH_CHECK_VALUE(n <= 1 || logits.stride(-1) == 1, op,
                    ": logits' last dim must have stride 1 (rows may be strided), got stride ",
                    text(logits.stride(-1)), "; pass logits.contiguous()");
  check_no_internal_overlap(op, logits, "logits");
  check_no_overlap(op, "target", logits, target, "logits");
  const at::ScalarType loss_dtype = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(losses.scalar_type() == loss_dtype && losses.device() == logits.device(), op,
              ": losses must be ", c10::toString(loss_dtype), " on logits' device (",
              logits.device(), "), got ", losses.scalar_type(), " on ", losses.device());
  TORCH_CHECK(losses.sizes().equals(target.sizes()) && losses.is_contiguous(), op,
              ": losses must be contiguous with target's shape ", text(target.sizes()), ", got ",
              text(losses.sizes()), " of strides ", text(losses.strides()));
  check_no_overlap(op, "logits", losses, logits, "losses");
  check_no_overlap(op, "target", losses, target, "losses");

  CrossEntropyPlan plan;
  plan.logits.rows = rows;
  plan.logits.n = n;
  plan.logits.col_stride = 1;
  build_row_index(op, "logits", logits.dim() - 1, logits, plan.logits.row);
  plan.target = target.contiguous();
  plan.params.ignore_index = ignore_index;
  plan.params.reduction = static_cast<CrossEntropyReduction>(reduction);
  plan.params.label_smoothing = label_smoothing;
  return plan;
}

namespace {

// What rope_ and rope_backward check of the tensor whose rows rotate (x, grad; `name`):
// floating, at least one dim, an even last dim.
void check_rope_rows(const char* op, const char* name, const at::Tensor& t) {
  check_float_dtype(op, name, t);
  TORCH_CHECK(t.dim() >= 1, op, ": ", name,
              " must have at least one dim (the rotated one), got a scalar");
  TORCH_CHECK_VALUE(t.size(-1) % 2 == 0, op, ": ", name,
                    "'s last dim must be even (its two halves rotate together), got ",
                    text(t.size(-1)));
}

// cos or sin (`name`) against the rotated tensor (`x_name`): its dtype and device, its last
// dim D with stride 1, broadcastable to its shape.
void check_rope_table(const char* op, const char* name, const at::Tensor& t, const char* x_name,
                      const at::Tensor& x) {
  check_like(op, name, t, x_name, x);
  const int64_t d = x.size(-1);
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == d, op, ": ", name, "'s last dim must equal ", x_name,
              "'s (", text(d), "), got ", name, " of shape ", text(t.sizes()));
  TORCH_CHECK(at::is_expandable_to(t.sizes(), x.sizes()), op, ": ", name, " of shape ",
              text(t.sizes()), " does not broadcast to ", x_name, "'s shape ", text(x.sizes()));
  check_unit_stride(op, name, t);
}

// The dims of t with its leading dims in memory order (by decreasing stride, ties as they
// are), the last dim last.
std::vector<int64_t> memory_order(const at::Tensor& t) {
  std::vector<int64_t> order(t.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end() - 1,
                   [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  return order;
}

// The layout's row count, half and tables: cos and sin expanded to `shape`, dims in `order`.
void plan_rope_tables(const char* op, const at::Tensor& cos, const at::Tensor& sin,
                      at::IntArrayRef shape, const std::vector<int64_t>& order,
                      RopeLayout& layout) {
  const int64_t lead = static_cast<int64_t>(shape.size()) - 1;
  build_row_index(op, "cos", lead, cos.expand(shape).permute(order), layout.cos);
  build_row_index(op, "sin", lead, sin.expand(shape).permute(order), layout.sin);
  const int64_t d = shape[lead];
  layout.half = d / 2;
  layout.rows = d == 0 ? 0 : c10::multiply_integers(shape) / d;
}

}  // namespace

RopePlan plan_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rope_";
  check_rope_rows(op, "x", x);
  check_unit_stride(op, "x", x);
  check_no_internal_overlap(op, x);
  check_rope_table(op, "cos", cos, "x", x);
  check_rope_table(op, "sin", sin, "x", x);
  check_no_overlap(op, "cos", x, cos);
  check_no_overlap(op, "sin", x, sin);
  RopePlan plan;
  const std::vector<int64_t> order = memory_order(x);
  build_row_index(op, "x", x.dim() - 1, x.permute(order), plan.layout.in);
  plan.layout.out = plan.layout.in;
  plan.layout.out_is_in = true;
  plan_rope_tables(op, cos, sin, x.sizes(), order, plan.layout);
  plan.in = x;
  return plan;
}

RopePlan plan_rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& grad_x) {
  const char* op = "rope_backward";
  check_rope_rows(op, "grad", grad);
  check_like(op, "grad_x", grad_x, "grad", grad);
  TORCH_CHECK(grad_x.sizes().equals(grad.sizes()), op, ": grad_x must have grad's shape ",
              text(grad.sizes()), ", got ", text(grad_x.sizes()));
  check_unit_stride(op, "grad_x", grad_x);
  check_no_internal_overlap(op, grad_x, "grad_x");
  check_rope_table(op, "cos", cos, "grad", grad);
  check_rope_table(op, "sin", sin, "grad", grad);
  check_no_overlap(op, "grad", grad_x, grad, "grad_x");
  check_no_overlap(op, "cos", grad_x, cos, "grad_x");
  check_no_overlap(op, "sin", grad_x, sin, "grad_x");
  RopePlan plan;
  const std::vector<int64_t> order = memory_order(grad_x);
  const int64_t lead = grad.dim() - 1;
  build_row_index(op, "grad_x", lead, grad_x.permute(order), plan.layout.out);
  // grad comes from autograd in any layout (an expanded one from .sum(), say): read a
  // contiguous copy where its rows are strided within or do not merge.
  plan.in = grad;
  if (grad.size(-1) > 1 && grad.stride(-1) != 1) plan.in = grad.contiguous();
  if (!try_row_index(lead, plan.in.permute(order), plan.layout.in)) {
    plan.in = grad.contiguous();
    build_row_index(op, "grad", lead, plan.in.permute(order), plan.layout.in);
  }
  plan_rope_tables(op, cos, sin, grad.sizes(), order, plan.layout);
  return plan;
}

void check_silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  const char* op = "silu_mul_backward_";
  check_float_dtype(op, "gate", gate);
  check_like(op, "up", up, "gate", gate);
  check_like(op, "grad", grad, "gate", gate);
  for (const auto& [name, t] : {std::pair{"up", &up}, std::pair{"grad", &grad}})
    TORCH_CHECK(t->sizes().equals(gate.sizes()), op, ": ", name, " must have gate's shape ",
                text(gate.sizes()), ", got ", text(t->sizes()));
  for (const auto& [name, t] :
       {std::pair{"grad", &grad}, std::pair{"gate", &gate}, std::pair{"up", &up}})
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " must be contiguous; pass ", name,
                      ".contiguous()");
  // Contiguous, gate and up share no memory within themselves: only across tensors.
  check_no_overlap(op, "up", gate, up, "gate");
  check_no_overlap(op, "grad", gate, grad, "gate");
  check_no_overlap(op, "grad", up, grad, "up");
}

}  // namespace mti
