// Every op schema of make_torch_inplace, in one place. Each op writes its result over x,
// declared honestly as Tensor(a!) so FakeTensor, functionalization (torch.compile) and the
// version counter see the mutation. The ops return nothing; the Python wrappers return x.
#include <torch/library.h>

TORCH_LIBRARY(make_torch_inplace, m) {
  // x[..., K] <- x @ W (or x @ W.T) + bias. W is (K, K). At most workspace_bytes of scratch;
  // 0 selects the kernel that needs none.
  m.def(
      "square_matmul_(Tensor(a!) x, Tensor weight, Tensor? bias, bool transpose, "
      "int workspace_bytes) -> ()");
  // x <- softmax(x * scale + mask) over dim (log_softmax when log). A bool mask is True where
  // an element takes part; a float mask is added. causal masks (i, j) with j > i over the last
  // two dims. A row with nothing unmasked becomes all zeros.
  m.def("softmax_(Tensor(a!) x, int dim, float scale, Tensor? mask, bool causal, bool log) -> ()");
  // x <- F.layer_norm(x, ...). rstd: empty, or `rows` float32 elements that receive
  // 1/sqrt(var + eps) of each row for the backward pass.
  m.def(
      "layer_norm_(Tensor(a!) x, int[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, Tensor(b!) rstd) -> ()");
  // x <- F.rms_norm(x, ...). rstd as for layer_norm_.
  m.def(
      "rms_norm_(Tensor(a!) x, int[] normalized_shape, Tensor? weight, float eps, "
      "Tensor(b!) rstd) -> ()");

  // Backward passes, computed from the forward's output y (its input is gone). They read y and
  // grad and write only the out arguments, never grad (autograd may share it between
  // consumers) nor y (other ops may have saved it). fp32 accumulation.
  //
  // softmax_'s backward: grad_x <- scale * dz, dz = y * (grad - sum(grad * y) / sum(y))
  // (softmax) or grad - exp(y) * sum(grad) / sum(exp(y)) (log, sums over the whole row);
  // elements masked by `mask` or `causal` (as in softmax_) get 0. grad_x: y's shape and dtype,
  // not overlapping y or grad.
  m.def(
      "softmax_backward(Tensor y, Tensor grad, int dim, float scale, Tensor? mask, "
      "bool causal, bool log, Tensor(a!) grad_x) -> ()");
  // layer_norm_'s (rms false) / rms_norm_'s (rms true, bias None) backward from y, the rstd
  // the forward saved and its weight/bias: x_hat = (y - bias) / weight (0 where weight == 0),
  // g_hat = grad * weight, grad_x <- rstd * (g_hat - mean(g_hat) - x_hat * mean(g_hat * x_hat))
  // (RMS: no mean(g_hat) term), grad_weight <- sum over rows of grad * x_hat, grad_bias <- sum
  // over rows of grad. An empty out argument is not computed; grad_weight / grad_bias have
  // weight's / bias's shape and dtype.
  m.def(
      "norm_backward(Tensor y, Tensor grad, int[] normalized_shape, Tensor? weight, "
      "Tensor? bias, Tensor rstd, bool rms, Tensor(a!) grad_x, Tensor(b!) grad_weight, "
      "Tensor(c!) grad_bias) -> ()");

  // Cross entropy of logits [..., V] (classes last) against int64 class indices target [...]:
  // losses[...] <- each row's loss (float32; float64 for float64 logits) and logits <- the
  // gradient of the loss w.r.t. logits, (softmax - (1 - eps) onehot - eps / V) per row, where
  // eps = label_smoothing. reduction (at::Reduction: 0 none, 1 mean, 2 sum) scales both: mean
  // divides every row by the number of rows whose target is not ignore_index, so that
  // losses.sum() is the mean loss and logits its gradient. Ignored rows: loss 0 (0 / 0 = NaN
  // for mean when every row is ignored, PyTorch's mean), gradient 0. A target outside
  // [0, V) other than ignore_index raises before logits is written.
  m.def(
      "cross_entropy_(Tensor(a!) logits, Tensor target, int ignore_index, int reduction, "
      "float label_smoothing, Tensor(b!) losses) -> ()");

  // Rotary position embedding (Hugging Face's apply_rotary_pos_emb for one tensor) of x's rows
  // of even length D = 2h: with x1, x2 = x[..., :h], x[..., h:] and c1, c2 / s1, s2 the halves
  // of cos / sin (broadcast to x's shape, last dim D),
  //   x1 <- x1 * c1 - x2 * s1,  x2 <- x2 * c2 + x1 * s2
  // in fp32 (fp64 for float64), rounded once to x's dtype.
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  // rope_'s backward, the transpose of its rotation, out of place (grad may be shared):
  //   grad_x1 <- g1 * c1 + g2 * s2,  grad_x2 <- g2 * c2 - g1 * s1
  // grad_x: grad's shape and dtype, stride(-1) == 1, overlapping none of grad, cos and sin.
  m.def("rope_backward(Tensor grad, Tensor cos, Tensor sin, Tensor(a!) grad_x) -> ()");

  // The backward of h = silu(gate) * up written over its inputs, which the caller no longer
  // needs: with s = sigmoid(gate),
  //   up <- grad * gate * s,  gate <- grad * up * s * (1 + gate * (1 - s))
  // in fp32 (fp64 for float64), each rounded once to the dtype. grad, gate and up: one
  // shape, dtype and device, contiguous, none overlapping another.
  m.def("silu_mul_backward_(Tensor grad, Tensor(a!) gate, Tensor(b!) up) -> ()");
}
