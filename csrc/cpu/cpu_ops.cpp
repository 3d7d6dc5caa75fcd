#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(make_torch_inplace, CPU, m) { MTI_REGISTER_BACKEND_OPS(m, mti::cpu) }
