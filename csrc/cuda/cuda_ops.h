// CUDA host functions of the make_torch_inplace ops (registered in cuda_ops.cu).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mti::cuda {

void square_matmul_(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transpose,
                    int64_t workspace_bytes);
void softmax_(const at::Tensor& x, int64_t dim, double scale,
              const std::optional<at::Tensor>& mask, bool causal, bool log);
void layer_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                 double eps, const at::Tensor& rstd);
void rms_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,
               const std::optional<at::Tensor>& weight, double eps, const at::Tensor& rstd);

}  // namespace mti::cuda
