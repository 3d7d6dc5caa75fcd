// CUDA host functions of the make_torch_inplace ops (registered in cuda_ops.cu).
#pragma once

#include "common/backend_ops.h"

namespace mti::cuda {
MTI_DECLARE_BACKEND_OPS
}  // namespace mti::cuda
