// The default square_matmul_ path, the same on every device: chunks of rows of x through
// ATen's GEMM (cuBLAS/cuBLASLt on CUDA) into a bounded workspace, each chunk copied back over
// its rows, as the backend's ChunkPipeline says when and where.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "common/plans.h"

namespace mti {

// How many rows each chunk of square_matmul_with_workspace holds and how many workspace
// buffers of that many rows the chunks rotate through (1: each chunk's copy-back must finish
// before the next GEMM; 2: the copy-back of one chunk may overlap the GEMM of the next).
// rows < 1 means that not even one row fits the workspace.
struct ChunkSchedule {
  int64_t rows = 0;
  int buffers = 1;
};

// Where and when the chunks of square_matmul_with_workspace are copied back over x. This base
// class is the in-order schedule (the CPU's): as many rows per chunk as the workspace holds,
// one buffer, each copy on the caller's stream right after its GEMM, so the hooks have
// nothing to order. The CUDA backend overrides it to copy on a side stream, overlapping the
// copy of one chunk with the GEMM of the next (cuda/square_matmul.cu).
class ChunkPipeline {
 public:
  virtual ~ChunkPipeline() = default;
  // The chunking of `rows` rows of row_bytes each within workspace_bytes (both > 0).
  virtual ChunkSchedule schedule(int64_t rows, int64_t row_bytes, int64_t workspace_bytes) const;
  // Called before a GEMM writes into `buffer`: what still reads that buffer must come first.
  virtual void before_gemm(int buffer) {}
  // Writes `chunk` (a GEMM result in `buffer`) over `dst`, the rows it was computed from.
  virtual void copy_back(const at::Tensor& dst, const at::Tensor& chunk, int buffer) {
    dst.copy_(chunk);
  }
  // Called once after the last copy_back, also when a GEMM threw, and before the workspace
  // is freed: everything queued later on the caller's stream must see the copies done.
  virtual void join() {}
};

// Whether `pipeline` would chunk x within workspace_bytes into GEMMs of so few rows (fewer
// than 8, and than x has) that the BLAS runs them with kernels less accurate than
// torch.matmul's GEMM of all the rows (in fp32 both cuBLAS and the CPU's BLAS do, with chunks
// of 1-3 rows). The backends then use their kernel without workspace, whose sums are at least
// as accurate.
inline bool chunks_lose_accuracy(const at::Tensor& x, const MatmulPlan& plan,
                                 int64_t workspace_bytes, const ChunkPipeline& pipeline) {
  constexpr int64_t kMinGemmRows = 8;
  if (workspace_bytes <= 0) return false;
  const int64_t rows =
      pipeline.schedule(plan.x.rows, plan.k * x.element_size(), workspace_bytes).rows;
  return rows > 0 && rows < std::min(plan.x.rows, kMinGemmRows);
}

// The default square_matmul_ path, the same on every device: chunks of rows through ATen's
// GEMM (cuBLAS/cuBLASLt on CUDA, bias fused as addmm's epilogue) into a workspace of at most
// workspace_bytes, each chunk copied back over its rows as `pipeline` says. When x is a
// single matrix that fits in one chunk, the GEMM writes a fresh tensor of x's size (at most
// workspace_bytes) that is copied over x: the sequence of torch.matmul + copy_, with the least
// host work. Returns nullptr when done, or, having written nothing, the reason it cannot run
// (less than one row fits, or the allocation failed), so the backend can use its
// zero-workspace kernel instead.
const char* square_matmul_with_workspace(const at::Tensor& x, const MatmulPlan& plan,
                                         int64_t workspace_bytes, ChunkPipeline& pipeline);

}  // namespace mti
