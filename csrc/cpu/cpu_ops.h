// CPU implementations of the make_torch_inplace ops (registered in cpu_ops.cpp).
#pragma once

#include "common/backend_ops.h"

namespace mti::cpu {
MTI_DECLARE_BACKEND_OPS
}  // namespace mti::cpu
