// square_matmul_ in float64 without workspace (f64.cu): the host side runs cuBLAS's DGEMM
// through a workspace where it has one, and this kernel where it has none. No torch here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti::square_matmul {

// The largest K the kernel takes on a GPU whose CTAs may opt into smem_optin bytes of shared
// memory: a row of K doubles must fit there.
int64_t f64_max_k(int smem_optin);

// x <- x @ W (W^T where transpose) + bias over each row of `layout` (K = layout.n <= f64_max_k,
// col_stride 1, rows not overlapping each other, w or bias); w: (K, K) contiguous; bias: K
// elements or nullptr. Each CTA copies a row into shared memory, then writes the row's outputs
// over it, each a dot product summed with an error-free transformation (TwoProduct, TwoSum),
// accurate as if summed in twice double's precision. Returns the launch's error.
cudaError_t launch_square_matmul_f64(double* x, const RowLayout& layout, const double* w,
                                     const double* bias, bool transpose, cudaStream_t stream);

}  // namespace mti::square_matmul
