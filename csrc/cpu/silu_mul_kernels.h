// The CPU silu_mul_backward_ kernel: the elements in parallel chunks (at::parallel_for), a
// block of vectors at a time in opmath (fp32, fp64 for double), each output rounded once.
// Included once per instruction set by isa_base.cpp and isa_avx2.cpp after ATen's vec
// headers, with MTI_CPU_ISA naming the namespace the kernel lands in (isa.h declares it).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu/isa.h"
#include "cpu/opmath_block.h"

#ifndef MTI_CPU_ISA
#error \
    "define MTI_CPU_ISA (the namespace of this instantiation) before including silu_mul_kernels.h"
#endif

namespace mti::cpu::MTI_CPU_ISA {
namespace {

// Elements per parallel task: enough work to outweigh a task's start.
constexpr int64_t kSiluMulGrain = 1 << 15;

// With s = sigmoid(g): up <- dy g s, gate <- dy u s (1 + g (1 - s)), for any A (scalar or
// Vectorized) given its exp of -g.
template <typename A>
void silu_mul_grads(const A& dy, A& g, A& u, const A& exp_neg_g) {
  const A one(1);
  const A s = one / (one + exp_neg_g);
  const A d_up = dy * g * s;
  g = dy * u * s * (one + g * (one - s));
  u = d_up;
}

template <typename scalar_t>
void silu_mul_backward_impl(const scalar_t* grad, scalar_t* gate, scalar_t* up, int64_t n) {
  using Block = OpmathBlock<scalar_t>;
  using acc_t = typename Block::acc_t;
  at::parallel_for(0, n, kSiluMulGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + Block::kSize <= end; i += Block::kSize) {
      const Block dy = Block::load(grad + i);
      Block g = Block::load(gate + i), u = Block::load(up + i);
      for (int p = 0; p < Block::kParts; ++p)
        silu_mul_grads(dy.v[p], g.v[p], u.v[p], g.v[p].neg().exp());
      g.store(gate + i);
      u.store(up + i);
    }
    for (; i < end; ++i) {
      acc_t g = static_cast<acc_t>(gate[i]), u = static_cast<acc_t>(up[i]);
      silu_mul_grads(static_cast<acc_t>(grad[i]), g, u, std::exp(-g));
      gate[i] = static_cast<scalar_t>(g);
      up[i] = static_cast<scalar_t>(u);
    }
  });
}

}  // namespace

// The overloads isa.h declares.
#define MTI_CPU_SILU_MUL_DEFS(T)                                           \
  void silu_mul_backward_elems(const T* grad, T* gate, T* up, int64_t n) { \
    silu_mul_backward_impl<T>(grad, gate, up, n);                          \
  }

MTI_CPU_SILU_MUL_DEFS(float)
MTI_CPU_SILU_MUL_DEFS(double)
MTI_CPU_SILU_MUL_DEFS(c10::Half)
MTI_CPU_SILU_MUL_DEFS(c10::BFloat16)

#undef MTI_CPU_SILU_MUL_DEFS

}  // namespace mti::cpu::MTI_CPU_ISA
