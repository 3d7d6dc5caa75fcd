// CPU rope_ and rope_backward: the entry points, which check and plan (common/plans.h) before
// anything is written, then run the vectorized kernel of rope_kernels.h for this CPU (isa.h).
#include <ATen/Dispatch.h>

#include "common/plans.h"
#include "cpu/cpu_ops.h"
#include "cpu/isa.h"
#include "cpu/rowwise_common.h"

namespace mti::cpu {
namespace {

void run(const RopePlan& plan, const at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
         bool backward) {
  if (plan.layout.rows == 0 || plan.layout.half == 0) return;
  MTI_CPU_DISPATCH(out.scalar_type(), "rope_", [&] {
    MTI_CPU_ISA_CALL(rope_rows, plan.in.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                     cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(), plan.layout,
                     backward);
  });
}

}  // namespace

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  run(plan_rope(x, cos, sin), x, cos, sin, /*backward=*/false);
}

void rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& grad_x) {
  run(plan_rope_backward(grad, cos, sin, grad_x), grad_x, cos, sin, /*backward=*/true);
}

}  // namespace mti::cpu
