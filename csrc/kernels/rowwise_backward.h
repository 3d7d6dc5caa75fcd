// Launchers of the backward kernels of softmax_ / log_softmax_ and layer_norm_ / rms_norm_
// (torch-free; kernels/rowwise_backward.cu). They read y (the forward's output) and grad and
// write grad_x, never y or grad; float32, float16 and bfloat16 (explicitly instantiated), fp32
// arithmetic. Each returns cudaGetLastError() after its launches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti {

// grad_x <- scale * dz per row, dz = y * (grad - sum(grad * y) / sum(y)) (softmax) or
// grad - exp(y) * sum(grad) / sum(exp(y)) (params.log), the sums over the whole row; 0 where
// the element is masked: mask_layout.kind kBool: `mask` bytes == 0; kAdditive: `mask` T values
// == -inf; params.causal: column j of row r with j > r % params.q_len.
template <typename T>
cudaError_t launch_softmax_backward(const T* y, const T* grad, T* grad_x, const BackwardRows& rows,
                                    const void* mask, const MaskLayout& mask_layout,
                                    const SoftmaxParams& params, cudaStream_t stream);

// Float32 scratch elements launch_norm_backward needs on the current device: partial column
// sums of grad_weight and grad_bias (0 when neither is wanted).
template <typename T>
cudaError_t norm_backward_scratch(const BackwardRows& rows, bool want_weight, bool want_bias,
                                  int64_t* scratch_floats);

// LayerNorm (rms false) / RMSNorm backward from y and the forward's rstd (`rows` floats):
// x_hat = (y - bias) / weight (0 where weight == 0), g_hat = grad * weight,
// grad_x <- rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat)) (RMS: no mean(g_hat)),
// grad_weight <- sum over rows of grad * x_hat, grad_bias <- sum over rows of grad (zeros
// without rows). weight, bias: nullptr or n contiguous elements; grad_x, grad_weight,
// grad_bias: nullptr (not wanted) or where to write (n contiguous elements for the latter
// two). scratch: norm_backward_scratch's count of floats; the column sums are deterministic.
template <typename T>
cudaError_t launch_norm_backward(const T* y, const T* grad, T* grad_x, const BackwardRows& rows,
                                 const T* weight, const T* bias, const float* rstd, bool rms,
                                 T* grad_weight, T* grad_bias, float* scratch,
                                 int64_t scratch_floats, cudaStream_t stream);

}  // namespace mti
