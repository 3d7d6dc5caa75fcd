// Launcher of the rope_ kernel (torch-free), the forward and its backward. Float32, float16,
// bfloat16 and float64 (explicitly instantiated in rope.cu); fp32 arithmetic, double for
// float64.
#pragma once

#include <cuda_runtime.h>

#include "kernels/rope/layout.h"

namespace mti {

// For each row of `layout`, with h = layout.half and the row's halves x1 = in[0, h),
// x2 = in[h, 2h) (likewise c1, c2 of cos and s1, s2 of sin), writes
//   forward:  out1 = x1 * c1 - x2 * s1,  out2 = x2 * c2 + x1 * s2
//   backward: out1 = x1 * c1 + x2 * s2,  out2 = x2 * c2 - x1 * s1  (the forward's transpose)
// each rounded once to T. `in` and `out` may be the same rows (the forward in place); out
// overlaps neither cos nor sin. One kernel on `stream`; returns the launch's error.
template <typename T>
cudaError_t launch_rope(const T* in, T* out, const T* cos, const T* sin, const RopeLayout& layout,
                        bool backward, cudaStream_t stream);

}  // namespace mti
