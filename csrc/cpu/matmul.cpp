// CPU square_matmul_: row chunks through ATen's GEMM into a bounded workspace, each chunk
// copied back over its rows; without a workspace (or with room for chunks of too few rows:
// chunks_lose_accuracy), one row at a time through a row buffer.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common/plans.h"
#include "cpu/cpu_ops.h"

namespace mti::cpu {
namespace {

// y[j] = sum_k row[k] * W[k, j] (or W[j, k] when transposed) + bias[j], written over row.
// The row is first read into a buffer, so writing the outputs cannot disturb the inputs.
// Sums run in double: a sequential fp32 dot product of K terms errs several times more than
// the blocked GEMM of the workspace path.
template <typename scalar_t>
void matmul_rows_no_workspace(scalar_t* x, const RowLayout& L, const scalar_t* w,
                              const scalar_t* bias, bool transpose) {
  using acc_t = double;
  const int64_t k = L.n;
  at::parallel_for(0, L.rows, std::max<int64_t>(1, 4096 / k), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> in(k), out(k);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x + L.row.offset(r);
      for (int64_t i = 0; i < k; ++i) in[i] = static_cast<acc_t>(row[i]);
      for (int64_t j = 0; j < k; ++j) out[j] = bias ? static_cast<acc_t>(bias[j]) : acc_t(0);
      if (transpose) {  // W[j, :] is contiguous: a dot product per output
        for (int64_t j = 0; j < k; ++j) {
          acc_t acc = 0;
          for (int64_t i = 0; i < k; ++i) acc += in[i] * static_cast<acc_t>(w[j * k + i]);
          out[j] += acc;
        }
      } else {  // W[i, :] is contiguous: accumulate row i of W scaled by in[i]
        for (int64_t i = 0; i < k; ++i)
          for (int64_t j = 0; j < k; ++j) out[j] += in[i] * static_cast<acc_t>(w[i * k + j]);
      }
      for (int64_t j = 0; j < k; ++j) row[j] = static_cast<scalar_t>(out[j]);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "square_matmul_", [&] {
    matmul_rows_no_workspace<scalar_t>(
        x.data_ptr<scalar_t>(), plan.x, plan.weight.const_data_ptr<scalar_t>(),
        plan.bias ? plan.bias->const_data_ptr<scalar_t>() : nullptr, plan.transpose);
  });
}

}  // namespace mti::cpu
