// The norms' parameter gradients (grad_weight, grad_bias) from the backward's partial column
// sums (kernels in param_sums.cu): each CTA (cluster) of the backward kernel, or of
// column_sums_kernel, sums grad * t (t = y - bias = x_hat * weight) and grad over the rows it
// handles into its own fp32 scratch row of n floats per array; a second kernel adds the
// partial rows of each column in a fixed order, so the result does not depend on scheduling,
// and divides grad_weight's by the weight.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"
#include "kernels/rowwise/tuning.h"

namespace mti {

template <typename T>
struct NormBackwardOp;

// Where the scratch rows of the parameter gradients start: [want_w ? P : 0 rows of grad_weight
// partials][want_b ? P : 0 rows of grad_bias partials], each row n floats.
struct Partials {
  float* w;                // nullptr: grad_weight not wanted
  float* b;                // nullptr: grad_bias not wanted
  bool smem_sums = false;  // streaming path: sum in dynamic shared memory, [w?][b?] x n floats
};

// Slices of a CTA's warps that share column_sums_kernel's rows.
constexpr int kColumnSlices = kMaxThreads / kWarpSize;

// The partial sums of streamed rows whose sums fit in no CTA's shared memory, in a pass of
// their own: `tiles` tiles of kWarpSize * VEC columns (VEC: kVec<T> where `vec`, else 1) by
// `slices` slices of the rows, each slice summing into its own scratch row of `part`.
template <typename T>
cudaError_t launch_column_sums(const T* y, const T* dy, const BackwardRows& rows,
                               const NormBackwardOp<T>& op, bool vec, int64_t tiles, int64_t slices,
                               const Partials& part, cudaStream_t stream);

// grad_weight and grad_bias (nullptr where not wanted) <- the column sums of the
// `partial_rows` scratch rows of each array of `part`, grad_weight's divided by `weight` (0
// where that is 0); at most `max_slices` slices of a CTA share the rows (tuning.h's
// kSumMaxSlices).
template <typename T>
cudaError_t launch_sum_partials(const Partials& part, int64_t partial_rows, int64_t n,
                                int64_t max_slices, const T* weight, T* grad_weight, T* grad_bias,
                                cudaStream_t stream);

}  // namespace mti
