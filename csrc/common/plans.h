// Argument checking (through common/checks.h) and layout planning shared by the CPU and CUDA
// backends.
//
// Every check an op makes runs here before the backend writes a byte of x, so an op that
// raises leaves x exactly as it was. The backends receive a plan that is known to be valid
// and only dispatch on dtype and launch.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/cross_entropy/params.h"
#include "kernels/rope/layout.h"
#include "kernels/row_layout.h"

namespace mti {

struct MatmulPlan {
  RowLayout x;  // rows of K elements, col_stride == 1
  int64_t k = 0;
  at::Tensor weight;       // (K, K), contiguous
  bool transpose = false;  // use weight.T: the caller's flag, flipped for a column-major weight
  std::optional<at::Tensor> bias;  // (K,), contiguous
};

struct SoftmaxPlan {
  RowLayout x;
  MaskLayout mask;
  at::Tensor mask_tensor;  // defined when mask.kind != kNone; data_ptr() is the base of `mask`
  SoftmaxParams params;
};

// cross_entropy_: logits as rows of V classes (col_stride 1), one int64 target per row.
struct CrossEntropyPlan {
  RowLayout logits;
  at::Tensor target;  // rows contiguous int64 values: the caller's, or a contiguous copy
  CrossEntropyParams params;
};

// rope_ and rope_backward: rows of the tensor read and of the one written (both x in the
// forward), cos and sin broadcast to their shape. The leading dims are taken in the written
// tensor's memory order (the rows an op runs through are the same whatever their order), so
// that rows run through memory as it lies and the rows that share a row of cos and sin (the
// heads of one position) come one after another.
struct RopePlan {
  RopeLayout layout;
  at::Tensor in;  // the tensor read: x, grad, or a contiguous copy of grad; base of layout.in
};

struct NormPlan {
  RowLayout x;             // rows over the normalized dims, merged into one
  at::Tensor weight;       // undefined or contiguous with n elements
  at::Tensor bias;         // undefined or contiguous with n elements
  bool save_rstd = false;  // rstd has `rows` elements of rstd_dtype(x) to fill
};

// A backward pass of a row-wise op: rows of y and grad read, rows of grad_x written. y and
// grad are the tensors to read: the caller's, or contiguous copies where their layouts do not
// merge with grad_x's. Softmax: views with dim moved last.
struct SoftmaxBackwardPlan {
  BackwardRows rows;
  at::Tensor y, grad;
  MaskLayout mask;
  at::Tensor mask_tensor;  // defined when mask.kind != kNone; data_ptr() is the base of `mask`
  SoftmaxParams params;
};

struct NormBackwardPlan {
  BackwardRows rows;  // rows.grad_x is meaningful only when want_x
  at::Tensor y, grad;
  at::Tensor weight;  // undefined or contiguous with n elements
  at::Tensor bias;    // undefined or contiguous with n elements
  bool rms = false;
  bool want_x = false;       // grad_x is written
  bool want_weight = false;  // grad_weight (contiguous, weight's dtype) is written
  bool want_bias = false;    // grad_bias (contiguous, bias's dtype) is written
};

// The dtype of the per-row rstd that the norms save for their backward: float64 for a float64
// x on CUDA, whose gradients are held to float64's accuracy; float32 otherwise (the CPU
// backend saves float32 for every dtype). make_torch_inplace/ops.py allocates the same.
at::ScalarType rstd_dtype(const at::Tensor& x);

MatmulPlan plan_square_matmul(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, bool transpose,
                              int64_t workspace_bytes);

SoftmaxPlan plan_softmax(const char* op, const at::Tensor& x, int64_t dim, double scale,
                         const std::optional<at::Tensor>& mask, bool causal, bool log);

// Checks logits (float, stride(-1) == 1, no internal overlap), target (int64, logits' device,
// shape logits.shape[:-1]), reduction (0 none, 1 mean, 2 sum: at::Reduction's values),
// label_smoothing in [0, 1] and losses (contiguous, target's shape, float32, or float64 for
// float64 logits; overlapping neither logits nor target). Target values are not read here:
// each backend checks them before it writes.
CrossEntropyPlan plan_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                    int64_t ignore_index, int64_t reduction, double label_smoothing,
                                    const at::Tensor& losses);

// rope_: x floating with an even last dim D, stride(-1) == 1 and no internal overlap; cos and
// sin of x's dtype and device, last dim D with stride 1, broadcastable to x's shape, not
// overlapping x.
RopePlan plan_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// rope_backward: grad as rope_'s x (any strides: read from a contiguous copy where its last
// dim is strided or its leading dims do not merge); cos and sin as rope_'s against grad;
// grad_x of grad's shape, dtype and device, stride(-1) == 1, no internal overlap, overlapping
// none of grad, cos and sin.
RopePlan plan_rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& grad_x);

// silu_mul_backward_: grad, gate and up floating, of one dtype, device and shape, contiguous,
// none overlapping another or itself.
void check_silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up);

// `op` is "layer_norm_" or "rms_norm_"; rms_norm_ passes no bias.
NormPlan plan_norm(const char* op, const at::Tensor& x, at::IntArrayRef normalized_shape,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& rstd);

// `op` is the name errors give ("softmax_backward"). Checks y, grad, the mask and grad_x
// (y's shape, dtype and device; no overlap with what is read) and plans the rows.
SoftmaxBackwardPlan plan_softmax_backward(const char* op, const at::Tensor& y,
                                          const at::Tensor& grad, int64_t dim, double scale,
                                          const std::optional<at::Tensor>& mask, bool causal,
                                          bool log, const at::Tensor& grad_x);

// `op` as above ("norm_backward"). grad_x, grad_weight, grad_bias: empty (not wanted) or the
// tensors to write, grad_weight / grad_bias contiguous in weight's / bias's shape and dtype.
// rstd: the forward's, `rows` contiguous values of rstd_dtype(y).
NormBackwardPlan plan_norm_backward(const char* op, const at::Tensor& y, const at::Tensor& grad,
                                    at::IntArrayRef normalized_shape,
                                    const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& rstd,
                                    bool rms, const at::Tensor& grad_x,
                                    const at::Tensor& grad_weight, const at::Tensor& grad_bias);

}  // namespace mti
