#include "common/chunked_gemm.h"

#include <functional>

namespace mti {

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

// Calls fn(first_row_offset, rows, row_stride) for each run of rows that is one strided
// matrix (rows x n, leading dimension row_stride), covering every row of `layout` once.
// Used to hand row blocks to GEMMs, which take a single leading dimension.
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
    const at::Tensor xm =
        x.dim() == 2 && x.stride(1) == 1
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

  // Every matrix for_each_matrix hands out has the same rows, so one balanced chunk height
  // serves them all; the workspace holds that, not the schedule's most (an output of 1.5
  // chunks would otherwise take 2 full buffers, more than the output itself).
  const int64_t matrix_rows = plan.x.row.ndim == 0 ? 1 : plan.x.row.sizes[plan.x.row.ndim - 1];
  const int64_t chunk = balanced_chunk_rows(matrix_rows, sched.rows);
  at::Tensor ws;
  try {
    // One allocation per call, from the caching allocator, so it counts in the allocator's
    // peak statistics like any other tensor.
    ws = at::empty({sched.buffers, chunk, k}, x.options());
  } catch (const c10::OutOfMemoryError&) {
    return "the workspace could not be allocated";
  }
  int64_t chunk_index = 0;
  const auto run_chunks = [&](int64_t offset, int64_t block_rows, int64_t ld) {
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

}  // namespace mti
