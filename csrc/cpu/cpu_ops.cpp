#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(make_torch_inplace, CPU, m) {
  m.impl("square_matmul_", &mti::cpu::square_matmul_);
  m.impl("softmax_", &mti::cpu::softmax_);
  m.impl("layer_norm_", &mti::cpu::layer_norm_);
  m.impl("rms_norm_", &mti::cpu::rms_norm_);
}
