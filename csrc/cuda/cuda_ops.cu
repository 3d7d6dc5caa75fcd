#include <torch/library.h>

#include "cuda/cuda_ops.h"

TORCH_LIBRARY_IMPL(make_torch_inplace, CUDA, m) { MTI_REGISTER_BACKEND_OPS(m, mti::cuda) }
