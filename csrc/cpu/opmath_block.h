// OpmathBlock, shared by the CPU kernels that compute elementwise in opmath (rope_kernels.h,
// silu_mul_kernels.h). Included after ATen's vec headers, with MTI_CPU_ISA naming the
// namespace of this instruction set's instantiation.
#pragma once

#include <ATen/OpMathType.h>

#include <array>
#include <cstdint>
#include <type_traits>

#ifndef MTI_CPU_ISA
#error "define MTI_CPU_ISA (the namespace of this instantiation) before including opmath_block.h"
#endif

namespace mti::cpu::MTI_CPU_ISA {
namespace {

// The elements of one Vectorized<scalar_t> as opmath vectors: one for fp32 and fp64, two
// float vectors for the 16-bit types.
template <typename scalar_t>
struct OpmathBlock {
  using acc_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int kParts = std::is_same_v<acc_t, scalar_t> ? 1 : 2;
  static constexpr int64_t kSize = at::vec::Vectorized<scalar_t>::size();
  std::array<Vec, kParts> v;

  static OpmathBlock load(const scalar_t* p) {
    OpmathBlock b;
    if constexpr (kParts == 1) {
      b.v[0] = Vec::loadu(p);
    } else {
      const auto [lo, hi] =
          at::vec::convert_to_float<scalar_t>(at::vec::Vectorized<scalar_t>::loadu(p));
      b.v = {lo, hi};
    }
    return b;
  }

  void store(scalar_t* p) const {
    if constexpr (kParts == 1)
      v[0].store(p);
    else
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
  }
};

}  // namespace
}  // namespace mti::cpu::MTI_CPU_ISA
