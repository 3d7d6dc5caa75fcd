#include "common/plans.h"

#include <ATen/WrapDimUtils.h>

#include <algorithm>
#include <vector>

namespace mti {

std::string text(int64_t v) { return std::to_string(v); }

std::string text(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  // float64 is accepted for gradcheck; the CUDA backend refuses it in its dtype dispatch.
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kDouble,
              op, ": ", name, " must be float32, float16, bfloat16 (or float64 on CPU), got ", dt);
}

void check_like_x(const char* op, const char* name, const at::Tensor& x, const at::Tensor& t) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " must be on x's device (", x.device(),
              "), got ", t.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype (",
              x.scalar_type(), "), got ", t.scalar_type());
}

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

// x is written while `other` is read: refuse any sharing of memory, including x being a view
// into other. Conservative: two interleaved but disjoint views of one storage are refused too.
void check_no_overlap(const char* op, const char* name, const at::Tensor& x,
                      const at::Tensor& other) {
  if (x.numel() == 0 || other.numel() == 0) return;
  if (!x.storage().is_alias_of(other.storage())) return;
  const auto a = byte_span(x);
  const auto b = byte_span(other);
  TORCH_CHECK(a.second <= b.first || b.second <= a.first, op, ": x overlaps ", name,
              " in memory; the op would overwrite ", name,
              " while reading it (pass a copy, e.g. ", name, ".clone())");
}

// Refuses x whose elements share memory (an expanded or as_strided view): writing one
// element would change another. Sufficient test: sorted by stride, each dim's stride must
// step over everything the smaller dims span.
void check_no_internal_overlap(const char* op, const at::Tensor& x) {
  if (x.numel() == 0) return;  // nothing is written; strides of an empty tensor are arbitrary
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1) dims.emplace_back(x.stride(d), x.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // max offset reached by the dims seen so far
  for (const auto& [stride, size] : dims) {
    TORCH_CHECK(stride > span, op, ": x has internally overlapping memory (stride ", text(stride),
                " with size ", text(size), "; e.g. an expanded tensor), so it cannot be written in "
                "place; pass x.contiguous()");
    span += stride * (size - 1);
  }
}

// Fills `index` with the leading dims [0, lead) of x (and of the optional tensor m, same
// shape as x), merging neighbours wherever every tensor allows it and dropping size-1 dims.
void build_row_index(const char* op, const at::Tensor& x, int64_t lead, RowIndexer& index,
                     const at::Tensor* m, RowIndexer* m_index) {
  struct Dim {
    int64_t size, xs, ms;
  };
  std::vector<Dim> merged;  // innermost first while building
  for (int64_t d = lead - 1; d >= 0; --d) {
    const int64_t size = x.size(d);
    if (size == 1) continue;
    const int64_t xs = x.stride(d), ms = m ? m->stride(d) : 0;
    if (!merged.empty()) {
      Dim& in = merged.back();
      if (xs == in.xs * in.size && ms == in.ms * in.size) {
        in.size *= size;
        continue;
      }
    }
    merged.push_back({size, xs, ms});
  }
  TORCH_CHECK_VALUE(static_cast<int>(merged.size()) <= kMaxLeadDims, op,
                    ": x's leading dims merge into ", text(static_cast<int64_t>(merged.size())),
                    " strided groups, more than ", text(kMaxLeadDims), " supported; pass x.contiguous()");
  std::reverse(merged.begin(), merged.end());
  index.ndim = static_cast<int>(merged.size());
  if (m_index) m_index->ndim = index.ndim;
  for (size_t i = 0; i < merged.size(); ++i) {
    index.sizes[i] = merged[i].size;
    index.strides[i] = merged[i].xs;
    if (m_index) {
      m_index->sizes[i] = merged[i].size;
      m_index->strides[i] = merged[i].ms;
    }
  }
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
  TORCH_CHECK_VALUE(k <= 1 || x.stride(-1) == 1, op,
                    ": x's last dim must have stride 1 (rows may be strided), got stride ",
                    text(x.stride(-1)), "; pass x.contiguous()");

  MatmulPlan plan;
  plan.k = k;
  plan.x.n = k;
  plan.x.rows = k == 0 ? 0 : x.numel() / k;
  plan.x.col_stride = 1;
  build_row_index(op, x, x.dim() - 1, plan.x.row, nullptr, nullptr);
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

SoftmaxPlan plan_softmax(const char* op, const at::Tensor& x, int64_t dim, double scale,
                         const std::optional<at::Tensor>& mask, bool causal, bool log) {
  check_float_dtype(op, "x", x);
  const int64_t ndim = x.dim();
  dim = at::maybe_wrap_dim(dim, std::max<int64_t>(ndim, 1));
  check_no_internal_overlap(op, x);
  TORCH_CHECK_VALUE(!causal || (ndim >= 2 && dim == ndim - 1), op,
                    ": causal=True needs x with at least 2 dims and dim=-1 (the mask covers the "
                    "last two dims), got x of ", text(ndim), " dims and dim=", text(dim));

  SoftmaxPlan plan;
  plan.params.scale = static_cast<float>(scale);
  plan.params.log = log;
  plan.params.causal = causal;
  plan.params.q_len = causal ? x.size(-2) : 1;

  // A 0-dim x is one row of one element.
  const at::Tensor xv = ndim == 0 ? x.view({1}) : x.movedim(dim, -1);
  at::Tensor mv;
  if (mask) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.device() == x.device(), op, ": mask must be on x's device (", x.device(),
                "), got ", m.device());
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == x.scalar_type(), op,
                ": mask must be bool or x's dtype (", x.scalar_type(), "), got ",
                m.scalar_type());
    TORCH_CHECK(at::is_expandable_to(m.sizes(), x.sizes()), op, ": mask of shape ", text(m.sizes()),
                " does not broadcast to x's shape ", text(x.sizes()));
    check_no_overlap(op, "mask", x, m);
    at::Tensor me = ndim == 0 ? m.reshape({1}) : m.expand(x.sizes()).movedim(dim, -1);
    plan.mask.kind = m.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
    plan.mask.col_stride = me.stride(-1);
    plan.mask_tensor = me;
    mv = me;
  }
  plan.x.n = xv.size(-1);
  plan.x.rows = plan.x.n == 0 ? 0 : xv.numel() / plan.x.n;
  plan.x.col_stride = xv.stride(-1);
  build_row_index(op, xv, xv.dim() - 1, plan.x.row, mask ? &mv : nullptr,
                  mask ? &plan.mask.row : nullptr);
  return plan;
}

NormPlan plan_norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd) {
  check_float_dtype(op, "x", x);
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(k >= 1 && k <= x.dim() &&
                  x.sizes().slice(x.dim() - k).equals(normalized_shape),
              op, ": normalized_shape ", text(normalized_shape),
              " must be non-empty and equal the trailing dims of x, got x of shape ",
              text(x.sizes()));
  for (const auto* t : {&weight, &bias}) {
    if (!*t) continue;
    const char* name = t == &weight ? "weight" : "bias";
    check_like_x(op, name, x, **t);
    TORCH_CHECK((*t)->sizes().equals(normalized_shape), op, ": ", name, " must have shape ",
                text(normalized_shape), ", got ", text((*t)->sizes()));
    check_no_overlap(op, name, x, **t);
  }
  check_no_internal_overlap(op, x);
  // The normalized dims must merge into one strided dim: normalized element i sits at
  // i * col_stride, col_stride being the stride of the innermost dim of size > 1.
  int64_t n = 1, col_stride = 0;
  for (int64_t d = x.dim() - 1; d >= x.dim() - k; --d) {
    if (x.size(d) > 1) {
      if (col_stride == 0) col_stride = x.stride(d);
      TORCH_CHECK_VALUE(x.stride(d) == col_stride * n, op,
                        ": the normalized dims of x must merge into one (as in a contiguous "
                        "tensor), got strides ", text(x.strides()), "; pass x.contiguous()");
    }
    n *= x.size(d);
  }
  NormPlan plan;
  plan.x.n = n;
  plan.x.rows = n == 0 ? 0 : x.numel() / n;
  plan.x.col_stride = col_stride == 0 ? 1 : col_stride;
  build_row_index(op, x, x.dim() - k, plan.x.row, nullptr, nullptr);
  if (weight) plan.weight = weight->contiguous();
  if (bias) plan.bias = bias->contiguous();
  if (rstd.numel() > 0) {
    TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() &&
                    rstd.numel() == plan.x.rows && rstd.device() == x.device(),
                op, ": rstd must be a contiguous float32 tensor of ", text(plan.x.rows),
                " elements on x's device, got ", rstd.scalar_type(), " of ", text(rstd.numel()));
    check_no_overlap(op, "rstd", x, rstd);
    plan.save_rstd = true;
  }
  return plan;
}

ChunkSchedule ChunkPipeline::schedule(int64_t rows, int64_t row_bytes,
                                      int64_t workspace_bytes) const {
  return {std::min(rows, workspace_bytes / row_bytes), 1};
}

namespace {

// Chunk heights are rounded up to this many rows: GEMM tiles are 64 to 256 rows high, so a
// chunk of a tile multiple leaves no partly filled row of tiles except at a block's end.
constexpr int64_t kChunkRowMultiple = 128;

// Rows per chunk for a block of `rows` rows when a chunk holds at most max_rows: as even as
// possible, since a small last chunk is a GEMM too small to fill the device that also leaves
// the copy-back of the chunk before it with nothing to overlap.
int64_t balanced_chunk_rows(int64_t rows, int64_t max_rows) {
  const int64_t chunks = (rows + max_rows - 1) / max_rows;
  const int64_t even = (rows + chunks - 1) / chunks;
  return std::min(max_rows, (even + kChunkRowMultiple - 1) / kChunkRowMultiple * kChunkRowMultiple);
}

}  // namespace

const char* square_matmul_with_workspace(const at::Tensor& x, const MatmulPlan& plan,
                                         int64_t workspace_bytes, ChunkPipeline& pipeline) {
  const int64_t k = plan.k;
  const int64_t rows = plan.x.rows;
  const ChunkSchedule sched = workspace_bytes > 0
      ? pipeline.schedule(rows, k * x.element_size(), workspace_bytes)
      : ChunkSchedule{};
  if (sched.rows < 1) return "workspace_bytes is smaller than one row";
  const at::Tensor wv = plan.transpose ? plan.weight.t() : plan.weight;

  if (sched.rows >= rows && plan.x.row.ndim <= 1) {
    // One chunk of one matrix (every small-M call): x as that matrix, the GEMM into a fresh
    // tensor, one copy back; no workspace tensor to carve up. A 2-D x with unit column
    // stride is that matrix already (the GEMM then takes it as it is, copying nothing), and
    // skipping the view saves a good part of the host time of a small call.
    const at::Tensor xm = x.dim() == 2 && x.stride(1) == 1
        ? x
        : x.as_strided({rows, k}, {plan.x.row.ndim == 0 ? k : plan.x.row.strides[0], 1},
                       x.storage_offset());
    at::Tensor out;
    try {
      out = plan.bias ? at::addmm(*plan.bias, xm, wv) : at::mm(xm, wv);
    } catch (const c10::OutOfMemoryError&) {
      return "the workspace could not be allocated";
    }
    xm.copy_(out);
    return nullptr;
  }

  at::Tensor ws;
  try {
    // One allocation per call, from the caching allocator, so it counts in the allocator's
    // peak statistics like any other tensor.
    ws = at::empty({sched.buffers, sched.rows, k}, x.options());
  } catch (const c10::OutOfMemoryError&) {
    return "the workspace could not be allocated";
  }
  int64_t chunk_index = 0;
  const auto run_chunks = [&](int64_t offset, int64_t block_rows, int64_t ld) {
    const int64_t chunk = balanced_chunk_rows(block_rows, sched.rows);
    for (int64_t r0 = 0; r0 < block_rows; r0 += chunk, ++chunk_index) {
      const int64_t r = std::min(chunk, block_rows - r0);
      const int buffer = static_cast<int>(chunk_index % sched.buffers);
      const at::Tensor xc = x.as_strided({r, k}, {ld, 1}, x.storage_offset() + offset + r0 * ld);
      at::Tensor out = ws.select(0, buffer).narrow(0, 0, r);
      pipeline.before_gemm(buffer);
      if (plan.bias)
        at::addmm_out(out, *plan.bias, xc, wv);
      else
        at::mm_out(out, xc, wv);
      pipeline.copy_back(xc, out, buffer);
    }
  };
  try {
    for_each_matrix(plan.x, run_chunks);
  } catch (...) {
    pipeline.join();  // the copies already queued still read ws, which is freed on the way out
    throw;
  }
  pipeline.join();
  return nullptr;
}

void for_each_matrix(const RowLayout& layout,
                     const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (layout.rows == 0) return;
  const RowIndexer& idx = layout.row;
  if (idx.ndim == 0) {
    fn(0, 1, layout.n);
    return;
  }
  // The innermost group is one strided matrix; loop over the others.
  const int64_t inner_rows = idx.sizes[idx.ndim - 1];
  const int64_t ld = idx.strides[idx.ndim - 1];
  for (int64_t block = 0; block < layout.rows / inner_rows; ++block)
    fn(idx.offset(block * inner_rows), inner_rows, ld);
}

}  // namespace mti
