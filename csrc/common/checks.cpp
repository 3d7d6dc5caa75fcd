#include "common/checks.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace mti {

std::string text(int64_t v) { return std::to_string(v); }

std::string text(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

// Byte range [begin, end) spanned by t's elements, or an empty range for an empty tensor.
std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  if (t.numel() == 0) return {nullptr, nullptr};
  const char* base = static_cast<const char*>(t.data_ptr());
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t ext = (t.size(d) - 1) * t.stride(d);
    (ext < 0 ? lo : hi) += ext;
  }
  return {base + lo * t.element_size(), base + (hi + 1) * t.element_size()};
}

}  // namespace

void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble, op,
              ": ", name, " must be float32, float16, bfloat16 or float64, got ", dt);
}

void check_like(const char* op, const char* name, const at::Tensor& t, const char* x_name,
                const at::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on ", x_name, "'s device (",
              x.device(), "), got ", t.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have ", x_name,
              "'s dtype (", x.scalar_type(), "), got ", t.scalar_type());
}

void check_like_x(const char* op, const char* name, const at::Tensor& x, const at::Tensor& t) {
  check_like(op, name, t, "x", x);
}

void check_no_overlap(const char* op, const char* name, const at::Tensor& x,
                      const at::Tensor& other, const char* x_name) {
  if (x.numel() == 0 || other.numel() == 0) return;
  if (!x.storage().is_alias_of(other.storage())) return;
  const auto a = byte_span(x);
  const auto b = byte_span(other);
  TORCH_CHECK(a.second <= b.first || b.second <= a.first, op, ": ", x_name, " overlaps ", name,
              " in memory; the op would overwrite ", name, " while reading it (pass a copy, e.g. ",
              name, ".clone())");
}

// Sufficient test: sorted by stride, each dim's stride must step over everything the smaller
// dims span.
void check_no_internal_overlap(const char* op, const at::Tensor& x, const char* x_name) {
  if (x.numel() == 0) return;  // nothing is written; strides of an empty tensor are arbitrary
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1) dims.emplace_back(x.stride(d), x.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // max offset reached by the dims seen so far
  for (const auto& [stride, size] : dims) {
    TORCH_CHECK(stride > span, op, ": ", x_name, " has internally overlapping memory (stride ",
                text(stride), " with size ", text(size),
                "; e.g. an expanded tensor), so it "
                "cannot be written in place; pass ",
                x_name, ".contiguous()");
    span += stride * (size - 1);
  }
}

}  // namespace mti
