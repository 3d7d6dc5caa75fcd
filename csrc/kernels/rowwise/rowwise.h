// Launchers of the row-wise kernels (torch-free): softmax_ / log_softmax_, layer_norm_ and
// rms_norm_ over rows, written over the input, and their backward passes, which read y (the
// forward's output) and grad and write grad_x, never y or grad. Float32, float16 and bfloat16
// (explicitly instantiated in softmax_forward.cu, norm_forward.cu, softmax_backward.cu and
// norm_backward.cu), fp32 arithmetic; float64 by the *_f64 launchers at the end (f64.cu), in
// double throughout. Each returns cudaGetLastError() after its launches.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti {

// Each row of `layout` <- softmax(z) (log_softmax(z) when params.log) with
// z = x * params.scale, plus the mask: mask_layout.kind kBool: `mask` holds bytes, nonzero =
// takes part, others get z = -inf; kAdditive: `mask` holds T values added to z (-inf masks
// too); kNone: `mask` is unused. params.causal additionally masks column j of row r when
// j > r % params.q_len. Masked elements become 0 (-inf for log_softmax); a row in which
// nothing takes part becomes all zeros.
template <typename T>
cudaError_t launch_softmax(T* x, const RowLayout& layout, const void* mask,
                           const MaskLayout& mask_layout, const SoftmaxParams& params,
                           cudaStream_t stream);

// Each row of `layout` <- (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) with
// the biased variance (F.layer_norm). weight and bias: nullptr or n contiguous elements.
// rstd_out: nullptr or `rows` floats that receive each row's rstd.
template <typename T>
cudaError_t launch_layer_norm(T* x, const RowLayout& layout, const T* weight, const T* bias,
                              float eps, float* rstd_out, cudaStream_t stream);

// Each row of `layout` <- x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) (F.rms_norm).
// weight and rstd_out as for launch_layer_norm.
template <typename T>
cudaError_t launch_rms_norm(T* x, const RowLayout& layout, const T* weight, float eps,
                            float* rstd_out, cudaStream_t stream);

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

// Float64: plain kernels (a CTA per row, several passes over global memory), no extra memory.
// Each does what its launcher above says, with these differences: the scale (softmax) and eps
// (norms) are doubles, and rstd is `rows` doubles; launch_norm_f64 is LayerNorm (rms false) or
// RMSNorm; launch_norm_backward_f64 needs no scratch.
cudaError_t launch_softmax_f64(double* x, const RowLayout& layout, const void* mask,
                               const MaskLayout& mask_layout, const SoftmaxParams& params,
                               double scale, cudaStream_t stream);
cudaError_t launch_norm_f64(double* x, const RowLayout& layout, const double* weight,
                            const double* bias, double eps, bool rms, double* rstd_out,
                            cudaStream_t stream);
cudaError_t launch_softmax_backward_f64(const double* y, const double* grad, double* grad_x,
                                        const BackwardRows& rows, const void* mask,
                                        const MaskLayout& mask_layout, const SoftmaxParams& params,
                                        double scale, cudaStream_t stream);
cudaError_t launch_norm_backward_f64(const double* y, const double* grad, double* grad_x,
                                     const BackwardRows& rows, const double* weight,
                                     const double* bias, const double* rstd, bool rms,
                                     double* grad_weight, double* grad_bias, cudaStream_t stream);

}  // namespace mti
