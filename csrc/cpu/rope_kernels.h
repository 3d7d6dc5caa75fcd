// The CPU rope_ kernel, forward and backward: rows in parallel (at::parallel_for), each half
// of a row a block of vectors at a time in opmath (fp32, fp64 for double), each output rounded
// once. Included once per instruction set by isa_base.cpp and isa_avx2.cpp after ATen's vec
// headers, with MTI_CPU_ISA naming the namespace the kernels land in (isa.h declares them).
// Writing over x needs no buffer: the outputs at columns j and h + j depend only on the inputs
// there, which are read first. No extra memory at all.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "cpu/isa.h"
#include "cpu/opmath_block.h"
#include "cpu/rowwise_common.h"

#ifndef MTI_CPU_ISA
#error "define MTI_CPU_ISA (the namespace of this instantiation) before including rope_kernels.h"
#endif

namespace mti::cpu::MTI_CPU_ISA {
namespace {

// out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 per row; the backward (the transpose) is the
// same with (s1, s2) replaced by (-s2, -s1): sin's halves read swapped and negated.
template <typename scalar_t>
void rope_rows_impl(const scalar_t* in, scalar_t* out, const scalar_t* cos, const scalar_t* sin,
                    const RopeLayout& L, bool backward) {
  using Block = OpmathBlock<scalar_t>;
  using acc_t = typename Block::acc_t;
  using Vec = typename Block::Vec;
  const int64_t h = L.half;
  const int64_t s_first = backward ? h : 0, s_second = backward ? 0 : h;
  const acc_t sign = backward ? acc_t(-1) : acc_t(1);
  at::parallel_for(0, L.rows, grain_rows(2 * h), [&](int64_t begin, int64_t end) {
    const Vec vsign(sign);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t in_off = L.in.offset(r);
      const scalar_t* x = in + in_off;
      scalar_t* y = out + (L.out_is_in ? in_off : L.out.offset(r));
      const scalar_t* c = cos + L.cos.offset(r);
      const scalar_t* s = sin + L.sin.offset(r);
      int64_t j = 0;
      for (; j + Block::kSize <= h; j += Block::kSize) {
        const Block x1 = Block::load(x + j), x2 = Block::load(x + h + j);
        const Block c1 = Block::load(c + j), c2 = Block::load(c + h + j);
        const Block s1 = Block::load(s + s_first + j), s2 = Block::load(s + s_second + j);
        Block y1, y2;
        for (int p = 0; p < Block::kParts; ++p) {
          y1.v[p] = at::vec::fmsub(x1.v[p], c1.v[p], x2.v[p] * (s1.v[p] * vsign));
          y2.v[p] = at::vec::fmadd(x2.v[p], c2.v[p], x1.v[p] * (s2.v[p] * vsign));
        }
        y1.store(y + j);
        y2.store(y + h + j);
      }
      for (; j < h; ++j) {
        const acc_t x1 = static_cast<acc_t>(x[j]), x2 = static_cast<acc_t>(x[h + j]);
        const acc_t s1 = sign * static_cast<acc_t>(s[s_first + j]);
        const acc_t s2 = sign * static_cast<acc_t>(s[s_second + j]);
        y[j] = static_cast<scalar_t>(x1 * static_cast<acc_t>(c[j]) - x2 * s1);
        y[h + j] = static_cast<scalar_t>(x2 * static_cast<acc_t>(c[h + j]) + x1 * s2);
      }
    }
  });
}

}  // namespace

// The overloads isa.h declares.
#define MTI_CPU_ROPE_DEFS(T)                                                           \
  void rope_rows(const T* in, T* out, const T* cos, const T* sin, const RopeLayout& L, \
                 bool backward) {                                                      \
    rope_rows_impl<T>(in, out, cos, sin, L, backward);                                 \
  }

MTI_CPU_ROPE_DEFS(float)
MTI_CPU_ROPE_DEFS(double)
MTI_CPU_ROPE_DEFS(c10::Half)
MTI_CPU_ROPE_DEFS(c10::BFloat16)

#undef MTI_CPU_ROPE_DEFS

}  // namespace mti::cpu::MTI_CPU_ISA
