// Every op schema of make_torch_inplace, in one place. Each op writes its result over x,
// declared honestly as Tensor(a!) so FakeTensor, functionalization (torch.compile) and the
// version counter see the mutation. The ops return nothing; the Python wrappers return x.
#include <torch/library.h>

TORCH_LIBRARY(make_torch_inplace, m) {
  // x[..., K] <- x @ W (or x @ W.T) + bias. W is (K, K). At most workspace_bytes of scratch;
  // 0 selects the kernel that needs none.
  m.def("square_matmul_(Tensor(a!) x, Tensor weight, Tensor? bias, bool transpose, "
        "int workspace_bytes) -> ()");
  // x <- softmax(x * scale + mask) over dim (log_softmax when log). A bool mask is True where
  // an element takes part; a float mask is added. causal masks (i, j) with j > i over the last
  // two dims. A row with nothing unmasked becomes all zeros.
  m.def("softmax_(Tensor(a!) x, int dim, float scale, Tensor? mask, bool causal, bool log) -> ()");
  // x <- F.layer_norm(x, ...). rstd: empty, or `rows` float32 elements that receive
  // 1/sqrt(var + eps) of each row for the backward pass.
  m.def("layer_norm_(Tensor(a!) x, int[] normalized_shape, Tensor? weight, Tensor? bias, "
        "float eps, Tensor(b!) rstd) -> ()");
  // x <- F.rms_norm(x, ...). rstd as for layer_norm_.
  m.def("rms_norm_(Tensor(a!) x, int[] normalized_shape, Tensor? weight, float eps, "
        "Tensor(b!) rstd) -> ()");
}
