// The CPU kernels, compiled once per instruction set (vec_kernels.h, rope_kernels.h and
// silu_mul_kernels.h, instantiated in isa_avx2.cpp with AVX2 + FMA and in isa_base.cpp for
// any CPU), and the run-time choice between them. The entry points (rowwise.cpp,
// rowwise_backward.cpp, rope.cpp, silu_mul.cpp) call MTI_CPU_ISA_CALL.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/rope/layout.h"
#include "kernels/row_layout.h"

// One overload per element type T; a mask is bool or T, nullptr for none.
#define MTI_CPU_ROWWISE_DECLS(T)                                                                   \
  void softmax_rows(T* x, const RowLayout& L, const bool* mask, const MaskLayout& ML,              \
                    const SoftmaxParams& p);                                                       \
  void softmax_rows(T* x, const RowLayout& L, const T* mask, const MaskLayout& ML,                 \
                    const SoftmaxParams& p);                                                       \
  void norm_rows(T* x, const RowLayout& L, const T* weight, const T* bias, double eps,             \
                 float* rstd_out, bool rms);                                                       \
  void softmax_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R,                \
                             const bool* mask, const MaskLayout& ML, const SoftmaxParams& p);      \
  void softmax_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R, const T* mask, \
                             const MaskLayout& ML, const SoftmaxParams& p);                        \
  void norm_backward_rows(const T* y, const T* dy, T* dx, const BackwardRows& R, const T* weight,  \
                          const T* bias, const float* rstd, bool rms);

// rope_ (rope_kernels.h): the forward in place (in == out), or its backward out of place.
#define MTI_CPU_ROPE_DECLS(T)                                                          \
  void rope_rows(const T* in, T* out, const T* cos, const T* sin, const RopeLayout& L, \
                 bool backward);

// silu_mul_backward_ (silu_mul_kernels.h): n contiguous elements, both gradients over gate
// and up.
#define MTI_CPU_SILU_MUL_DECLS(T) \
  void silu_mul_backward_elems(const T* grad, T* gate, T* up, int64_t n);

#define MTI_CPU_DECLS_ALL              \
  MTI_CPU_ROWWISE_DECLS(float)         \
  MTI_CPU_ROWWISE_DECLS(double)        \
  MTI_CPU_ROWWISE_DECLS(c10::Half)     \
  MTI_CPU_ROWWISE_DECLS(c10::BFloat16) \
  MTI_CPU_ROPE_DECLS(float)            \
  MTI_CPU_ROPE_DECLS(double)           \
  MTI_CPU_ROPE_DECLS(c10::Half)        \
  MTI_CPU_ROPE_DECLS(c10::BFloat16)    \
  MTI_CPU_SILU_MUL_DECLS(float)        \
  MTI_CPU_SILU_MUL_DECLS(double)       \
  MTI_CPU_SILU_MUL_DECLS(c10::Half)    \
  MTI_CPU_SILU_MUL_DECLS(c10::BFloat16)

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MTI_CPU_HAVE_AVX2_BUILD 1
#endif

namespace mti::cpu {

namespace base {
MTI_CPU_DECLS_ALL
}  // namespace base

#ifdef MTI_CPU_HAVE_AVX2_BUILD
namespace avx2 {
MTI_CPU_DECLS_ALL
}  // namespace avx2
#endif

// Whether the AVX2 kernels run: the CPU has AVX2 and FMA, and ATen's own kernels run at
// AVX2 or above (so ATEN_CPU_CAPABILITY=default selects the portable kernels here too).
bool use_avx2();

}  // namespace mti::cpu

#ifdef MTI_CPU_HAVE_AVX2_BUILD
#define MTI_CPU_ISA_CALL(fn, ...) \
  (::mti::cpu::use_avx2() ? ::mti::cpu::avx2::fn(__VA_ARGS__) : ::mti::cpu::base::fn(__VA_ARGS__))
#else
#define MTI_CPU_ISA_CALL(fn, ...) ::mti::cpu::base::fn(__VA_ARGS__)
#endif
