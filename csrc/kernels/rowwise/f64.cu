// The row-wise ops in float64 (declared in rowwise.h): small, plain kernels that favour accuracy
// and code size over speed. One CTA per row at a time, several passes over the row in global
// memory (each element is written last, by the thread that read it, so the forward passes work
// in place), every sum and product in double; block reductions fold the warps' results in a
// fixed order, so the results do not depend on scheduling. No extra memory.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/rowwise/rowwise.h"

namespace mti {
namespace {

constexpr int kF64Threads = 256;
constexpr int kF64Warps = kF64Threads / 32;
// Enough CTAs to fill any GPU several times over; each walks rows grid-stride.
constexpr int64_t kF64MaxCtas = 8192;

constexpr double kInf = INFINITY;

// Every thread's v folded over the CTA (kF64Threads threads), the same value in every thread.
// `scratch`: kF64Warps doubles of shared memory, free for reuse once this returns.
template <class Op>
__device__ double block_fold(double v, Op op, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double r = scratch[0];
  for (int w = 1; w < kF64Warps; ++w) r = op(r, scratch[w]);
  __syncthreads();
  return r;
}

__device__ __forceinline__ double block_sum(double v, double* scratch) {
  return block_fold(v, [](double a, double b) { return a + b; }, scratch);
}

__device__ __forceinline__ double block_max(double v, double* scratch) {
  return block_fold(v, [](double a, double b) { return a > b ? a : b; }, scratch);
}

// Which elements of a row take part in a softmax: the mask (bool bytes, nonzero = takes part,
// or additive doubles, -inf = masked) and the causal limit.
struct RowMask {
  const void* mask;
  MaskKind kind;
  int64_t offset, col_stride;
  int64_t last;  // the last column that takes part (causal), else n - 1

  __device__ RowMask(const void* m, const MaskLayout& ml, int64_t row, const SoftmaxParams& p,
                     int64_t n)
      : mask(m),
        kind(ml.kind),
        offset(ml.kind == MaskKind::kNone ? 0 : ml.row.offset(row)),
        col_stride(ml.col_stride),
        last(p.causal ? row % p.q_len : n - 1) {}

  // The logit of x at column j: x * scale plus the additive mask; -inf where masked.
  __device__ double logit(double x, int64_t j, double scale) const {
    if (j > last) return -kInf;
    double z = x * scale;
    if (kind == MaskKind::kBool && static_cast<const uint8_t*>(mask)[offset + j * col_stride] == 0)
      return -kInf;
    if (kind == MaskKind::kAdditive) z += static_cast<const double*>(mask)[offset + j * col_stride];
    return z;
  }

  __device__ bool active(int64_t j) const { return logit(0.0, j, 1.0) != -kInf; }
};

__global__ void __launch_bounds__(kF64Threads)
    softmax_f64_kernel(double* x, const RowLayout layout, const void* mask, const MaskLayout ml,
                       const SoftmaxParams p, double scale) {
  __shared__ double scratch[kF64Warps];
  const int64_t n = layout.n, cs = layout.col_stride;
  for (int64_t r = blockIdx.x; r < layout.rows; r += gridDim.x) {
    double* row = x + layout.row.offset(r);
    const RowMask m(mask, ml, r, p, n);
    double mx = -kInf;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads)
      mx = fmax(mx, m.logit(row[j * cs], j, scale));
    mx = block_max(mx, scratch);
    if (mx == -kInf) {  // nothing takes part: the row becomes zeros (documented)
      for (int64_t j = threadIdx.x; j < n; j += kF64Threads) row[j * cs] = 0.0;
      continue;
    }
    double sum = 0;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads)
      sum += exp(m.logit(row[j * cs], j, scale) - mx);
    sum = block_sum(sum, scratch);
    const double log_sum = log(sum);
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      const double d = m.logit(row[j * cs], j, scale) - mx;
      row[j * cs] = p.log ? d - log_sum : exp(d) / sum;
    }
  }
}

// grad_x = dz * scale, dz = y * (g - sum(g * y) / sum(y)) or g - exp(y) * sum(g) / sum(exp(y))
// (log), the sums over the whole row; 0 where an element does not take part (as the CPU's).
__global__ void __launch_bounds__(kF64Threads)
    softmax_backward_f64_kernel(const double* y, const double* grad, double* grad_x,
                                const BackwardRows rows, const void* mask, const MaskLayout ml,
                                const SoftmaxParams p, double scale) {
  __shared__ double scratch[kF64Warps];
  const int64_t n = rows.y.n;
  for (int64_t r = blockIdx.x; r < rows.y.rows; r += gridDim.x) {
    const double* yr = y + rows.y.row.offset(r);
    const double* gr = grad + rows.grad.row.offset(r);
    double* dr = grad_x + rows.grad_x.row.offset(r);
    const RowMask m(mask, ml, r, p, n);
    double s = 0, total = 0;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      const double g = gr[j * rows.grad.col_stride], v = yr[j * rows.y.col_stride];
      s += p.log ? g : g * v;
      total += p.log ? exp(v) : v;
    }
    s = block_sum(s, scratch);
    total = block_sum(total, scratch);
    s = total > 0 ? s / total : 0.0;  // 0: no element takes part
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      double out = 0;
      if (m.active(j)) {
        const double g = gr[j * rows.grad.col_stride], v = yr[j * rows.y.col_stride];
        out = (p.log ? g - exp(v) * s : v * (g - s)) * scale;
      }
      dr[j * rows.grad_x.col_stride] = out;
    }
  }
}

// LayerNorm (rms false) / RMSNorm: the mean, then the centred squares (accurate when
// |mean| >> std), then the outputs.
__global__ void __launch_bounds__(kF64Threads)
    norm_f64_kernel(double* x, const RowLayout layout, const double* weight, const double* bias,
                    double eps, bool rms, double* rstd_out) {
  __shared__ double scratch[kF64Warps];
  const int64_t n = layout.n, cs = layout.col_stride;
  for (int64_t r = blockIdx.x; r < layout.rows; r += gridDim.x) {
    double* row = x + layout.row.offset(r);
    double mean = 0;
    if (!rms) {
      for (int64_t j = threadIdx.x; j < n; j += kF64Threads) mean += row[j * cs];
      mean = block_sum(mean, scratch) / static_cast<double>(n);
    }
    double sq = 0;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      const double d = row[j * cs] - mean;
      sq += d * d;
    }
    sq = block_sum(sq, scratch);
    const double rstd = 1.0 / sqrt(sq / static_cast<double>(n) + eps);
    if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[r] = rstd;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      double v = (row[j * cs] - mean) * rstd;
      if (weight != nullptr) v *= weight[j];
      if (bias != nullptr) v += bias[j];
      row[j * cs] = v;
    }
  }
}

// The normalized input recovered from the output: (y - bias) / weight, 0 where weight is 0.
__device__ __forceinline__ double x_hat_f64(double v, const double* weight, const double* bias,
                                            int64_t j) {
  if (bias != nullptr) v -= bias[j];
  if (weight == nullptr) return v;
  return weight[j] != 0 ? v / weight[j] : 0.0;
}

// grad_x = rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)), g_hat = grad * weight
// (RMSNorm: no mean(g_hat)).
__global__ void __launch_bounds__(kF64Threads)
    norm_backward_f64_kernel(const double* y, const double* grad, double* grad_x,
                             const BackwardRows rows, const double* weight, const double* bias,
                             const double* rstd, bool rms) {
  __shared__ double scratch[kF64Warps];
  const int64_t n = rows.y.n;
  for (int64_t r = blockIdx.x; r < rows.y.rows; r += gridDim.x) {
    const double* yr = y + rows.y.row.offset(r);
    const double* gr = grad + rows.grad.row.offset(r);
    double* dr = grad_x + rows.grad_x.row.offset(r);
    const auto g_hat = [&](int64_t j) {
      const double g = gr[j * rows.grad.col_stride];
      return weight != nullptr ? g * weight[j] : g;
    };
    double sum_g = 0, sum_gx = 0;
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      const double gh = g_hat(j);
      sum_g += gh;
      sum_gx += gh * x_hat_f64(yr[j * rows.y.col_stride], weight, bias, j);
    }
    const double mean_g = rms ? 0.0 : block_sum(sum_g, scratch) / static_cast<double>(n);
    const double mean_gx = block_sum(sum_gx, scratch) / static_cast<double>(n);
    for (int64_t j = threadIdx.x; j < n; j += kF64Threads) {
      const double xh = x_hat_f64(yr[j * rows.y.col_stride], weight, bias, j);
      dr[j * rows.grad_x.col_stride] = rstd[r] * (g_hat(j) - mean_g - xh * mean_gx);
    }
  }
}

// grad_weight[j] = sum over rows of grad * x_hat, grad_bias[j] = sum over rows of grad, one
// thread per column summing the rows in order (either output may be nullptr: not wanted).
__global__ void __launch_bounds__(kF64Threads)
    norm_param_grads_f64_kernel(const double* y, const double* grad, const BackwardRows rows,
                                const double* weight, const double* bias, double* grad_weight,
                                double* grad_bias) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kF64Threads + threadIdx.x;
  if (j >= rows.y.n) return;
  double acc_w = 0, acc_b = 0;
  for (int64_t r = 0; r < rows.y.rows; ++r) {
    const double g = grad[rows.grad.row.offset(r) + j * rows.grad.col_stride];
    acc_b += g;
    if (grad_weight != nullptr)
      acc_w += g * x_hat_f64(y[rows.y.row.offset(r) + j * rows.y.col_stride], weight, bias, j);
  }
  if (grad_weight != nullptr) grad_weight[j] = acc_w;
  if (grad_bias != nullptr) grad_bias[j] = acc_b;
}

unsigned row_ctas(int64_t rows) {
  return static_cast<unsigned>(rows < kF64MaxCtas ? rows : kF64MaxCtas);
}

}  // namespace

cudaError_t launch_softmax_f64(double* x, const RowLayout& layout, const void* mask,
                               const MaskLayout& mask_layout, const SoftmaxParams& params,
                               double scale, cudaStream_t stream) {
  if (layout.rows > 0 && layout.n > 0)
    softmax_f64_kernel<<<row_ctas(layout.rows), kF64Threads, 0, stream>>>(
        x, layout, mask, mask_layout, params, scale);
  return cudaGetLastError();
}

cudaError_t launch_norm_f64(double* x, const RowLayout& layout, const double* weight,
                            const double* bias, double eps, bool rms, double* rstd_out,
                            cudaStream_t stream) {
  if (layout.rows > 0 && layout.n > 0)
    norm_f64_kernel<<<row_ctas(layout.rows), kF64Threads, 0, stream>>>(x, layout, weight, bias, eps,
                                                                       rms, rstd_out);
  return cudaGetLastError();
}

cudaError_t launch_softmax_backward_f64(const double* y, const double* grad, double* grad_x,
                                        const BackwardRows& rows, const void* mask,
                                        const MaskLayout& mask_layout, const SoftmaxParams& params,
                                        double scale, cudaStream_t stream) {
  if (rows.y.rows > 0 && rows.y.n > 0)
    softmax_backward_f64_kernel<<<row_ctas(rows.y.rows), kF64Threads, 0, stream>>>(
        y, grad, grad_x, rows, mask, mask_layout, params, scale);
  return cudaGetLastError();
}

cudaError_t launch_norm_backward_f64(const double* y, const double* grad, double* grad_x,
                                     const BackwardRows& rows, const double* weight,
                                     const double* bias, const double* rstd, bool rms,
                                     double* grad_weight, double* grad_bias, cudaStream_t stream) {
  if (grad_x != nullptr && rows.y.rows > 0 && rows.y.n > 0)
    norm_backward_f64_kernel<<<row_ctas(rows.y.rows), kF64Threads, 0, stream>>>(
        y, grad, grad_x, rows, weight, bias, rstd, rms);
  if ((grad_weight != nullptr || grad_bias != nullptr) && rows.y.n > 0)
    norm_param_grads_f64_kernel<<<static_cast<unsigned>(ceil_div(rows.y.n, kF64Threads)),
                                  kF64Threads, 0, stream>>>(y, grad, rows, weight, bias,
                                                            grad_weight, grad_bias);
  return cudaGetLastError();
}

}  // namespace mti
