// CPU silu_mul_backward_: checks (common/plans.h) before anything is written, then the
// vectorized kernel of silu_mul_kernels.h for this CPU (isa.h).
#include <ATen/Dispatch.h>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {

void silu_mul_backward_(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul_backward(grad, gate, up);
  MTI_CPU_DISPATCH(gate.scalar_type(), "silu_mul_backward_", [&] {
    MTI_CPU_ISA_CALL(silu_mul_backward_elems, grad.const_data_ptr<scalar_t>(),
                     gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), gate.numel());
  });
}

}  // namespace mti::cpu
