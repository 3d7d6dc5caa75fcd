#include <torch/library.h>

#include "cuda/cuda_ops.h"

TORCH_LIBRARY_IMPL(make_torch_inplace, CUDA, m) {
  m.impl("square_matmul_", &mti::cuda::square_matmul_);
  m.impl("softmax_", &mti::cuda::softmax_);
  m.impl("layer_norm_", &mti::cuda::layer_norm_);
  m.impl("rms_norm_", &mti::cuda::rms_norm_);
}
