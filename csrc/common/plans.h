// Argument checking and layout planning shared by the CPU and CUDA backends.
//
// Every check an op makes lives here and runs before the backend writes a byte of x, so an
// op that raises leaves x exactly as it was. The backends receive a plan that is known to be
// valid and only dispatch on dtype and launch.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <string>

#include "kernels/row_layout.h"

namespace mti {

// Integers and shapes as text for error messages. TORCH_CHECK would stream them through
// std::ostream's integer insertion, which crashes inside extensions built against some torch
// wheels (seen with torch 2.11 and GCC 13: a segfault in ostream::_M_insert<long> while
// formatting the message), so the messages pass text only.
std::string text(int64_t v);
std::string text(at::IntArrayRef shape);

struct MatmulPlan {
  RowLayout x;     // rows of K elements, col_stride == 1
  int64_t k = 0;
  at::Tensor weight;  // (K, K), contiguous
  bool transpose = false;  // use weight.T: the caller's flag, flipped for a column-major weight
  std::optional<at::Tensor> bias;  // (K,), contiguous
};

struct SoftmaxPlan {
  RowLayout x;
  MaskLayout mask;
  at::Tensor mask_tensor;  // defined when mask.kind != kNone; data_ptr() is the base of `mask`
  SoftmaxParams params;
};

struct NormPlan {
  RowLayout x;           // rows over the normalized dims, merged into one
  at::Tensor weight;     // undefined or contiguous with n elements
  at::Tensor bias;       // undefined or contiguous with n elements
  bool save_rstd = false;  // rstd has `rows` float32 elements to fill
};

// A backward pass of a row-wise op: rows of y and grad read, rows of grad_x written. y and
// grad are the tensors to read: the caller's, or contiguous copies where their layouts do not
// merge with grad_x's. Softmax: views with dim moved last.
struct SoftmaxBackwardPlan {
  BackwardRows rows;
  at::Tensor y, grad;
  MaskLayout mask;
  at::Tensor mask_tensor;  // defined when mask.kind != kNone; data_ptr() is the base of `mask`
  SoftmaxParams params;
};

struct NormBackwardPlan {
  BackwardRows rows;     // rows.grad_x is meaningful only when want_x
  at::Tensor y, grad;
  at::Tensor weight;     // undefined or contiguous with n elements
  at::Tensor bias;       // undefined or contiguous with n elements
  bool rms = false;
  bool want_x = false;       // grad_x is written
  bool want_weight = false;  // grad_weight (contiguous, weight's dtype) is written
  bool want_bias = false;    // grad_bias (contiguous, bias's dtype) is written
};

MatmulPlan plan_square_matmul(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool transpose,
                              int64_t workspace_bytes);

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
// torch.matmul's GEMM of all the rows: in fp32, cuBLAS measured 1.8-2.5x its error with chunks
// of 1-2 rows (H100, K = 1000), the CPU's BLAS 2.7x with chunks of 3 and 1 rows (AMD EPYC,
// torch 2.13, K = 1000). The backends then use their kernel without workspace, whose sums are
// at least as accurate.
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

SoftmaxPlan plan_softmax(const char* op, const at::Tensor& x, int64_t dim, double scale,
                         const std::optional<at::Tensor>& mask, bool causal, bool log);

// `op` is "layer_norm_" or "rms_norm_"; rms_norm_ passes no bias.
NormPlan plan_norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd);

// `op` is the name errors give ("softmax_backward"). Checks y, grad, the mask and grad_x
// (y's shape, dtype and device; no overlap with what is read) and plans the rows.
SoftmaxBackwardPlan plan_softmax_backward(const char* op, const at::Tensor& y,
                                          const at::Tensor& grad, int64_t dim, double scale,
                                          const std::optional<at::Tensor>& mask, bool causal,
                                          bool log, const at::Tensor& grad_x);

// `op` as above ("norm_backward"). grad_x, grad_weight, grad_bias: empty (not wanted) or the
// tensors to write, grad_weight / grad_bias contiguous in weight's / bias's shape and dtype.
// rstd: the forward's, `rows` contiguous float32 values.
NormBackwardPlan plan_norm_backward(const char* op, const at::Tensor& y, const at::Tensor& grad,
                                    at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias,
                                    const at::Tensor& rstd, bool rms, const at::Tensor& grad_x,
                                    const at::Tensor& grad_weight, const at::Tensor& grad_bias);

// Calls fn(first_row_offset, rows, row_stride) for each run of rows that is one strided
// matrix (rows x n, leading dimension row_stride), covering every row of `layout` once.
// Used to hand row blocks to GEMMs, which take a single leading dimension.
void for_each_matrix(const RowLayout& layout,
                     const std::function<void(int64_t offset, int64_t rows, int64_t ld)>& fn);

}  // namespace mti
