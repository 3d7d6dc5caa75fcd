// The entry points every backend implements, one per schema in registration.cpp. Each
// backend declares them in its own namespace (mti::cpu, mti::cuda) with
// MTI_DECLARE_BACKEND_OPS, so the signatures are written once.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#define MTI_DECLARE_BACKEND_OPS                                                                    \
  void square_matmul_(const at::Tensor& x, const at::Tensor& weight,                               \
                      const std::optional<at::Tensor>& bias, bool transpose,                       \
                      int64_t workspace_bytes);                                                    \
  void softmax_(const at::Tensor& x, int64_t dim, double scale,                                    \
                const std::optional<at::Tensor>& mask, bool causal, bool log);                     \
  void layer_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,                          \
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, \
                   double eps, const at::Tensor& rstd);                                            \
  void rms_norm_(const at::Tensor& x, at::IntArrayRef normalized_shape,                            \
                 const std::optional<at::Tensor>& weight, double eps, const at::Tensor& rstd);     \
  void softmax_backward(const at::Tensor& y, const at::Tensor& grad, int64_t dim, double scale,    \
                        const std::optional<at::Tensor>& mask, bool causal, bool log,              \
                        const at::Tensor& grad_x);                                                 \
  void norm_backward(const at::Tensor& y, const at::Tensor& grad,                                  \
                     at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,    \
                     const std::optional<at::Tensor>& bias, const at::Tensor& rstd, bool rms,      \
                     const at::Tensor& grad_x, const at::Tensor& grad_weight,                      \
                     const at::Tensor& grad_bias);                                                 \
  void cross_entropy_(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,    \
                      int64_t reduction, double label_smoothing, const at::Tensor& losses);        \
  void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);                   \
  void rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,         \
                     const at::Tensor& grad_x);                                                    \
  void silu_mul_backward_(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up);

// Registers a backend's entry points for one dispatch key.
#define MTI_REGISTER_BACKEND_OPS(m, ns)              \
  m.impl("square_matmul_", &ns::square_matmul_);     \
  m.impl("softmax_", &ns::softmax_);                 \
  m.impl("layer_norm_", &ns::layer_norm_);           \
  m.impl("rms_norm_", &ns::rms_norm_);               \
  m.impl("softmax_backward", &ns::softmax_backward); \
  m.impl("norm_backward", &ns::norm_backward);       \
  m.impl("cross_entropy_", &ns::cross_entropy_);     \
  m.impl("rope_", &ns::rope_);                       \
  m.impl("rope_backward", &ns::rope_backward);       \
  m.impl("silu_mul_backward_", &ns::silu_mul_backward_);
