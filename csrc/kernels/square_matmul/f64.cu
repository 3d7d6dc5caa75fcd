// The float64 square matmul without workspace (f64.h): simple and accurate rather than fast.
#include "kernels/square_matmul/f64.h"

#include "kernels/common.cuh"

namespace mti::square_matmul {
namespace {

constexpr int kThreads = 256;

// The output j of a row: sum over i of row[i] * W(i, j) (+ bias[j]), W(i, j) at
// w[i * w_row + j * w_col]. Each product's rounding error (an fma) and each addition's (TwoSum)
// are summed apart and added at the end (Ogita, Rump and Oishi's Dot2).
__device__ double dot2(const double* row, const double* w, int64_t k, int64_t w_row, int64_t w_col,
                       int64_t j, double start) {
  double s = start, err = 0;
  for (int64_t i = 0; i < k; ++i) {
    const double a = row[i], b = w[i * w_row + j * w_col];
    const double p = a * b;
    const double p_err = fma(a, b, -p);
    const double t = s + p;
    const double z = t - s;
    err += p_err + ((s - (t - z)) + (p - z));
    s = t;
  }
  return isfinite(s) ? s + err : s;  // inf or NaN: as the plain sum gives it
}

__global__ void __launch_bounds__(kThreads)
    square_matmul_f64_kernel(double* x, const RowLayout layout, const double* w, const double* bias,
                             bool transpose) {
  extern __shared__ double row[];
  const int64_t k = layout.n;
  const int64_t w_row = transpose ? 1 : k, w_col = transpose ? k : 1;
  for (int64_t r = blockIdx.x; r < layout.rows; r += gridDim.x) {
    double* xr = x + layout.row.offset(r);
    for (int64_t i = threadIdx.x; i < k; i += kThreads) row[i] = xr[i];
    __syncthreads();
    for (int64_t j = threadIdx.x; j < k; j += kThreads)
      xr[j] = dot2(row, w, k, w_row, w_col, j, bias != nullptr ? bias[j] : 0.0);
    __syncthreads();  // the next row reuses `row`
  }
}

}  // namespace

int64_t f64_max_k(int smem_optin) {
  return static_cast<int64_t>(smem_optin) / static_cast<int64_t>(sizeof(double));
}

cudaError_t launch_square_matmul_f64(double* x, const RowLayout& layout, const double* w,
                                     const double* bias, bool transpose, cudaStream_t stream) {
  if (layout.rows == 0 || layout.n == 0) return cudaSuccess;
  DeviceInfo device;
  cudaError_t err = current_device(&device);
  if (err != cudaSuccess) return err;
  const size_t smem = static_cast<size_t>(layout.n) * sizeof(double);
  // Also lifts the kernel's shared memory limit past 48 KiB where the row needs it.
  const int resident =
      occupancy_units(square_matmul_f64_kernel, kThreads, 1, smem, device.sm_count);
  if (resident == 0) return cudaErrorInvalidConfiguration;
  const int64_t ctas = layout.rows < resident ? layout.rows : resident;
  square_matmul_f64_kernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(
      x, layout, w, bias, transpose);
  return cudaGetLastError();
}

}  // namespace mti::square_matmul
