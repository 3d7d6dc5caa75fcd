// The kernels of the norms' parameter gradients (param_sums.h) and their launchers.
#include "kernels/rowwise/param_sums.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/rowwise/norm_backward_op.cuh"

namespace mti {
namespace {

// out[c] <- sum over p of partials[p * n + c], p in order, for the array blockIdx.y (0:
// grad_weight when wanted, else grad_bias); grad_weight's partials sum grad * t, so its sums
// are divided by weight[c] (0 where that is 0, as x_hat is there). The CTA's threads form
// `slices` (a power of two <= kMaxThreads) slices of kMaxThreads / slices lanes; lane i owns
// VEC columns, and slice s sums the partial rows s, s + slices, ... of them (kSumChains rows
// in flight per thread); then the CTA adds the slices' sums of each column in order. The
// launcher takes as many slices as there are partial rows, up to kSumMaxSlices: a few
// hundred rows (N <= 4096) need many loads in flight per column, a few dozen (clusters, at
// N >= 8192) over many columns need few CTAs that each cover more.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    sum_partials_kernel(const Partials part, int64_t partial_rows, int64_t n, int slices,
                        const T* weight, T* grad_weight, T* grad_bias) {
  __shared__ float sums[kMaxThreads * VEC];  // [slice][column of the CTA]
  const bool weight_array = blockIdx.y == 0 && grad_weight != nullptr;
  const float* src = weight_array ? part.w : part.b;
  T* out = weight_array ? grad_weight : grad_bias;
  const int lanes = kMaxThreads / slices;
  const int cols = lanes * VEC;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int slice = static_cast<int>(threadIdx.x) / lanes;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * cols + lane * VEC;
  float acc[kSumChains][VEC] = {};
  if (c0 < n) {
    auto add_row = [&](float (&a)[VEC], int64_t p) {
      const Packed<float, VEC> v = load_vec<VEC>(src + p * n, c0, 1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a[j] += v.v[j];
    };
    int64_t p = slice;
    for (; p + (kSumChains - 1) * slices < partial_rows; p += kSumChains * slices) {
#pragma unroll
      for (int i = 0; i < kSumChains; ++i) add_row(acc[i], p + i * slices);
    }
    for (; p < partial_rows; p += slices) add_row(acc[0], p);
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float s = acc[0][j];
#pragma unroll
    for (int i = 1; i < kSumChains; ++i) s += acc[i][j];
    sums[slice * cols + lane * VEC + j] = s;
  }
  __syncthreads();
  // Up to VEC columns per thread (one slice: every thread's columns).
  for (int col = static_cast<int>(threadIdx.x); col < cols; col += kMaxThreads) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * cols + col;
    if (c >= n) break;
    float total = sums[col];
    for (int i = 1; i < slices; ++i) total += sums[i * cols + col];
    if (weight_array) {
      const float w = to_float(weight[c]);
      total = w == 0.f ? 0.f : total / w;
    }
    out[c] = from_float<T>(total);
  }
}

// Streamed rows whose parameter gradient sums fit in no CTA's shared memory: backward_kernel
// computes grad_x only, and this kernel reads y and dy once more to sum grad * x_hat and grad
// by columns. CTA (x, s) owns the kWarpSize * VEC columns of tile x and the rows
// s * kColumnSlices + w + i * gridDim.y * kColumnSlices for its warps w; it adds its warps'
// sums in order into scratch row s (sum_partials_kernel then adds the scratch rows).
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    column_sums_kernel(const T* __restrict__ y, const T* __restrict__ dy, const BackwardRows L,
                       const NormBackwardOp<T> op, const Partials part) {
  __shared__ float sums_w[kColumnSlices][kWarpSize * VEC];
  __shared__ float sums_b[kColumnSlices][kWarpSize * VEC];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int slice = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t n = L.y.n;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kWarpSize + lane) * VEC;
  const int64_t ycs = VEC == 1 ? L.y.col_stride : 1;
  const int64_t gcs = VEC == 1 ? L.grad.col_stride : 1;
  float acc_w[VEC] = {}, acc_b[VEC] = {};
  if (c0 < n) {
    const int64_t stride = int64_t{gridDim.y} * kColumnSlices;
    for (int64_t r = int64_t{blockIdx.y} * kColumnSlices + slice; r < L.y.rows; r += stride) {
      float yf[VEC], gf[VEC], t[VEC], gh[VEC];
      to_floats(yf, load_vec<VEC>(y + L.y.row.offset(r), c0, ycs));
      to_floats(gf, load_vec<VEC>(dy + L.grad.row.offset(r), c0, gcs));
      op.terms(t, gh, yf, gf, op.template columns<VEC>(c0));
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        acc_w[j] += gf[j] * t[j];
        acc_b[j] += gf[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sums_w[slice][lane * VEC + j] = acc_w[j];
    sums_b[slice][lane * VEC + j] = acc_b[j];
  }
  __syncthreads();
  if (slice != 0 || c0 >= n) return;
  const int64_t out = int64_t{blockIdx.y} * n + c0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float w = sums_w[0][lane * VEC + j], b = sums_b[0][lane * VEC + j];
#pragma unroll
    for (int i = 1; i < kColumnSlices; ++i) {
      w += sums_w[i][lane * VEC + j];
      b += sums_b[i][lane * VEC + j];
    }
    if (part.w) part.w[out + j] = w;
    if (part.b) part.b[out + j] = b;
  }
}

}  // namespace

template <typename T>
cudaError_t launch_column_sums(const T* y, const T* dy, const BackwardRows& rows,
                               const NormBackwardOp<T>& op, bool vec, int64_t tiles, int64_t slices,
                               const Partials& part, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(slices));
  if (vec)
    column_sums_kernel<T, kVec<T>><<<grid, kMaxThreads, 0, stream>>>(y, dy, rows, op, part);
  else
    column_sums_kernel<T, 1><<<grid, kMaxThreads, 0, stream>>>(y, dy, rows, op, part);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_sum_partials(const Partials& part, int64_t partial_rows, int64_t n,
                                int64_t max_slices, const T* weight, T* grad_weight, T* grad_bias,
                                cudaStream_t stream) {
  // 16-byte loads where every partial row is 16-byte aligned (the scratch is, and n % 4 == 0
  // keeps the rows so).
  constexpr int kSumVec = 4;
  const float* scratch = part.w ? part.w : part.b;
  const bool vec = n % kSumVec == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0;
  const int slices = static_cast<int>(
      std::min<int64_t>(max_slices, next_pow2(std::max<int64_t>(1, partial_rows))));
  const int64_t cols = int64_t{kMaxThreads} / slices * (vec ? kSumVec : 1);
  const int arrays = int{grad_weight != nullptr} + int{grad_bias != nullptr};
  const dim3 grid(static_cast<unsigned>(ceil_div(n, cols)), static_cast<unsigned>(arrays));
  if (vec)
    sum_partials_kernel<T, kSumVec><<<grid, kMaxThreads, 0, stream>>>(
        part, partial_rows, n, slices, weight, grad_weight, grad_bias);
  else
    sum_partials_kernel<T, 1><<<grid, kMaxThreads, 0, stream>>>(part, partial_rows, n, slices,
                                                                weight, grad_weight, grad_bias);
  return cudaGetLastError();
}

#define MTI_INSTANTIATE_PARAM_SUMS(T)                                                          \
  template cudaError_t launch_column_sums<T>(const T*, const T*, const BackwardRows&,          \
                                             const NormBackwardOp<T>&, bool, int64_t, int64_t, \
                                             const Partials&, cudaStream_t);                   \
  template cudaError_t launch_sum_partials<T>(const Partials&, int64_t, int64_t, int64_t,      \
                                              const T*, T*, T*, cudaStream_t);
MTI_INSTANTIATE_PARAM_SUMS(float)
MTI_INSTANTIATE_PARAM_SUMS(__half)
MTI_INSTANTIATE_PARAM_SUMS(__nv_bfloat16)
#undef MTI_INSTANTIATE_PARAM_SUMS

}  // namespace mti
