// The CPU kernels for any CPU: ATen's portable Vectorized (fixed-size arrays that the
// compiler vectorizes with the baseline instruction set), and the run-time choice of kernels.
#include <ATen/Version.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // the vec headers' "#pragma unroll"
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#pragma GCC diagnostic pop

#define MTI_CPU_ISA base
#include "cpu/rope_kernels.h"
#include "cpu/silu_mul_kernels.h"
#include "cpu/vec_kernels.h"

namespace mti::cpu {

bool use_avx2() {
#ifdef MTI_CPU_HAVE_AVX2_BUILD
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && at::get_cpu_capability() != "DEFAULT";
  return yes;
#else
  return false;
#endif
}

}  // namespace mti::cpu
