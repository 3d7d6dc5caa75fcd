// LayerNorm / RMSNorm backward from the forward's output y and rstd: the launchers of the
// backward kernel (backward.cuh) with NormBackwardOp, and of the parameter gradient sums
// (param_sums.h).
// Instantiated once per dtype, in norm_backward_{f32,f16,bf16}.cu, which the build compiles in
// parallel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/rowwise/backward.cuh"
#include "kernels/rowwise/norm_backward_op.cuh"
#include "kernels/rowwise/param_sums.h"
#include "kernels/rowwise/rowwise.h"

namespace mti {
namespace {

bool norm_aligned(const void* y, const void* dy, const void* dx, const BackwardRows& L,
                  const void* weight, const void* bias, int64_t elem) {
  const RowIndexer one_row;  // ndim 0: only the base pointer is checked
  return all_rows_aligned(y, dy, dx, L, elem) &&
         (weight == nullptr || rows_aligned(weight, one_row, elem, 16)) &&
         (bias == nullptr || rows_aligned(bias, one_row, elem, 16));
}

}  // namespace

template <typename T>
cudaError_t norm_backward_scratch(const BackwardRows& rows, bool want_weight, bool want_bias,
                                  int64_t* scratch_floats) {
  *scratch_floats = 0;
  const int arrays = int{want_weight} + int{want_bias};
  if (arrays == 0 || rows.y.n == 0) return cudaSuccess;
  int device = 0;
  DeviceInfo dev;
  const cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  // The widest launch (vector path): its grid is capped by the same bound, and the scalar path
  // of the same rows never needs more partial rows than the bound allows either.
  const Launch l = plan_launch<NormBackwardOp<T>, T>(rows, /*aligned=*/true, arrays, device, dev);
  const Launch ls = plan_launch<NormBackwardOp<T>, T>(rows, /*aligned=*/false, arrays, device, dev);
  *scratch_floats = std::max(l.partial_rows, ls.partial_rows) * rows.y.n * arrays;
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_norm_backward(const T* y, const T* grad, T* grad_x, const BackwardRows& rows,
                                 const T* weight, const T* bias, const float* rstd, bool rms,
                                 T* grad_weight, T* grad_bias, float* scratch,
                                 int64_t scratch_floats, cudaStream_t stream) {
  const int64_t n = rows.y.n;
  const int arrays = int{grad_weight != nullptr} + int{grad_bias != nullptr};
  if (n == 0 || (rows.y.rows == 0 && arrays == 0)) return cudaSuccess;
  int device = 0;
  DeviceInfo dev;
  cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  NormBackwardOp<T> op;
  op.weight = weight;
  op.bias = bias;
  op.rstd = rstd;
  op.inv_n = 1.f / static_cast<float>(n);
  op.rms = rms;
  const bool aligned = norm_aligned(y, grad, grad_x, rows, weight, bias, sizeof(T));
  const Launch l = plan_launch<NormBackwardOp<T>, T>(rows, aligned, arrays, device, dev);
  if (l.partial_rows * n * arrays > scratch_floats) return cudaErrorInvalidValue;
  Partials part{nullptr, nullptr};
  if (grad_weight) part.w = scratch;
  if (grad_bias) part.b = scratch + (grad_weight ? l.partial_rows * n : 0);
  if (rows.y.rows > 0 && l.column_tiles > 0) {
    err = launch_paths(y, grad, grad_x, rows, op, l, Partials{nullptr, nullptr}, stream);
    if (err != cudaSuccess) return err;
    err =
        launch_column_sums(y, grad, rows, op, l.vec, l.column_tiles, l.partial_rows, part, stream);
    if (err != cudaSuccess) return err;
  } else if (rows.y.rows > 0) {
    err = launch_paths(y, grad, grad_x, rows, op, l, part, stream);
    if (err != cudaSuccess) return err;
  }
  if (arrays == 0) return cudaSuccess;
  return launch_sum_partials(part, l.partial_rows, n,
                             tuned(kSumMaxSlices, tuning_key(dev, sizeof(T), n)), weight,
                             grad_weight, grad_bias, stream);
}

#define MTI_INSTANTIATE_NORM_BACKWARD(T)                                                       \
  template cudaError_t norm_backward_scratch<T>(const BackwardRows&, bool, bool, int64_t*);    \
  template cudaError_t launch_norm_backward<T>(const T*, const T*, T*, const BackwardRows&,    \
                                               const T*, const T*, const float*, bool, T*, T*, \
                                               float*, int64_t, cudaStream_t);

}  // namespace mti
