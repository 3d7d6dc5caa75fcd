// Launchers of the LayerNorm and RMSNorm kernels (torch-free; kernels/norm.cu).
#pragma once

#include <cuda_runtime.h>

#include "kernels/row_layout.h"

namespace mti {

// Each row of `layout` <- (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) with
// the biased variance (F.layer_norm). weight and bias: nullptr or n contiguous elements.
// rstd_out: nullptr or `rows` floats that receive each row's rstd. Float32, float16 and
// bfloat16 (explicitly instantiated), fp32 statistics. Returns cudaGetLastError() after the
// launch.
template <typename T>
cudaError_t launch_layer_norm(T* x, const RowLayout& layout, const T* weight, const T* bias,
                              float eps, float* rstd_out, cudaStream_t stream);

// Each row of `layout` <- x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) (F.rms_norm).
// weight and rstd_out as for launch_layer_norm.
template <typename T>
cudaError_t launch_rms_norm(T* x, const RowLayout& layout, const T* weight, float eps,
                            float* rstd_out, cudaStream_t stream);

}  // namespace mti
