// CPU square_matmul_: row chunks through ATen's GEMM into a bounded workspace, each chunk
// copied back over its rows; without a workspace, one row at a time through a row buffer.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <vector>

#include "common/plans.h"
#include "cpu/cpu_ops.h"

namespace mti::cpu {
namespace {

// y[j] = sum_k row[k] * W[k, j] (or W[j, k] when transposed) + bias[j], written over row.
// The row is first read into a buffer, so writing the outputs cannot disturb the inputs.
template <typename scalar_t>
void matmul_rows_no_workspace(scalar_t* x, const RowLayout& L, const scalar_t* w,
                              const scalar_t* bias, bool transpose) {
  using acc_t = at::opmath_type<scalar_t>;
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
  TORCH_CHECK_VALUE(workspace_bytes >= 0, "square_matmul_: workspace_bytes must be >= 0, got ",
                    workspace_bytes);
  const MatmulPlan plan = plan_square_matmul(x, weight, bias);
  const int64_t k = plan.k, rows = plan.x.rows;
  if (rows == 0 || k == 0) return;

  const int64_t chunk = std::min(rows, workspace_bytes / (k * x.element_size()));
  if (chunk == 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "square_matmul_",
                                    [&] {
                                      matmul_rows_no_workspace<scalar_t>(
                                          x.data_ptr<scalar_t>(), plan.x,
                                          plan.weight.const_data_ptr<scalar_t>(),
                                          plan.bias ? plan.bias->const_data_ptr<scalar_t>() : nullptr,
                                          transpose);
                                    });
    return;
  }
  const at::Tensor w = transpose ? plan.weight.t() : plan.weight;
  at::Tensor workspace = at::empty({chunk, k}, x.options());
  for_each_matrix(plan.x, [&](int64_t offset, int64_t block_rows, int64_t ld) {
    for (int64_t r0 = 0; r0 < block_rows; r0 += chunk) {
      const int64_t r = std::min(chunk, block_rows - r0);
      at::Tensor xs = x.as_strided({r, k}, {ld, 1}, x.storage_offset() + offset + r0 * ld);
      at::Tensor out = workspace.narrow(0, 0, r);
      if (plan.bias)
        at::addmm_out(out, *plan.bias, xs, w);
      else
        at::mm_out(out, xs, w);
      xs.copy_(out);
    }
  });
}

}  // namespace mti::cpu
