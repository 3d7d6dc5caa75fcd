// CPU square_matmul_: row chunks through ATen's GEMM into a bounded workspace, each chunk
// copied back over its rows (common/chunked_gemm.h); without a workspace (or with room for
// chunks of too few rows: chunks_lose_accuracy), blocks of rows through a block buffer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "common/chunked_gemm.h"
#include "common/plans.h"
#include "cpu/cpu_ops.h"

namespace mti::cpu {
namespace {

// Rows per block of the zero-workspace path: GEMMs this high run at nearly the speed of one
// GEMM over all rows, and the buffer stays small (kMaxBlockRows * K elements).
constexpr int64_t kMaxBlockRows = 128;

// x <- x @ W (+ bias) a block of rows at a time: the block's rows are copied into a buffer,
// and ATen's GEMM (the BLAS of torch.matmul) writes the result from that buffer over them.
// Blocks are balanced (at least half of kMaxBlockRows, or all rows), so no GEMM runs on so
// few rows that the BLAS picks its less accurate small-M kernels (see chunks_lose_accuracy).
// Threads take whole blocks, each GEMM then single-threaded (one parallel region per call,
// not one per GEMM); a call of one block runs its GEMM on every thread. Where a block's rows
// are not one strided matrix (x with unmergeable leading dims), the GEMM writes into a second
// buffer, scattered over the rows afterwards.
// Extra memory: one buffer of at most kMaxBlockRows x K elements per thread (two in that case).
void matmul_blocks_no_workspace(const at::Tensor& x, const MatmulPlan& plan) {
  const RowLayout& L = plan.x;
  const int64_t k = plan.k;
  const int64_t blocks = (L.rows + kMaxBlockRows - 1) / kMaxBlockRows;
  const int64_t block_rows = (L.rows + blocks - 1) / blocks;
  const at::Tensor wv = plan.transpose ? plan.weight.t() : plan.weight;
  const int64_t es = x.element_size();
  char* base = static_cast<char*>(x.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const at::Tensor in = at::empty({block_rows, k}, x.options());
    at::Tensor out_buf;  // allocated only for a block that is not one strided matrix
    char* in_ptr = static_cast<char*>(in.data_ptr());
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * block_rows, r = std::min(block_rows, L.rows - r0);
      const int64_t first = L.row.offset(r0);
      const int64_t ld = r > 1 ? L.row.offset(r0 + 1) - first : k;
      bool strided = ld >= k;
      for (int64_t i = 0; i < r; ++i) {
        const int64_t off = L.row.offset(r0 + i);
        strided = strided && off == first + i * ld;
        std::memcpy(in_ptr + i * k * es, base + off * es, k * es);
      }
      const at::Tensor a = in.narrow(0, 0, r);
      at::Tensor out;
      if (strided) {
        out = x.as_strided({r, k}, {ld, 1}, x.storage_offset() + first);
      } else {
        if (!out_buf.defined()) out_buf = at::empty({block_rows, k}, x.options());
        out = out_buf.narrow(0, 0, r);
      }
      if (plan.bias)
        at::addmm_out(out, *plan.bias, a, wv);
      else
        at::mm_out(out, a, wv);
      if (!strided) {
        const char* src = static_cast<const char*>(out_buf.data_ptr());
        for (int64_t i = 0; i < r; ++i)
          std::memcpy(base + L.row.offset(r0 + i) * es, src + i * k * es, k * es);
      }
    }
  });
}

}  // namespace

void square_matmul_(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transpose,
                    int64_t workspace_bytes) {
  const MatmulPlan plan = plan_square_matmul(x, weight, bias, transpose, workspace_bytes);
  if (plan.x.rows == 0) return;  // also K == 0
  ChunkPipeline in_order;
  if (!chunks_lose_accuracy(x, plan, workspace_bytes, in_order) &&
      square_matmul_with_workspace(x, plan, workspace_bytes, in_order) == nullptr)
    return;
  matmul_blocks_no_workspace(x, plan);
}

}  // namespace mti::cpu
