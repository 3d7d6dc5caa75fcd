// The CPU kernels compiled for AVX2 + FMA (isa.h runs them where the CPU has both).
// Everything that is not ATen's vec headers or these kernels is included first, compiled for
// any CPU, so that no inline function shared with other files is built with AVX2 here. The
// vec headers then see CPU_CAPABILITY AVX2, as in ATen's own AVX2 kernels, and put their types
// in ATen's at::vec::AVX2 namespace.
#include "cpu/isa.h"

#ifdef MTI_CPU_HAVE_AVX2_BUILD
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/complex.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/rowwise_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// The target pragma enables the instructions but, unlike -mavx2, does not define the macros
// that announce them, which sleef.h (the vector math behind Vectorized<float>::exp) and the
// vec headers test; they are defined here, for exactly the instructions enabled above.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // the vec headers' "#pragma unroll"
#pragma GCC diagnostic ignored "-Wpsabi"  // AVX types in their signatures, as in ATen's build
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#pragma GCC diagnostic pop

#define MTI_CPU_ISA avx2
#include "cpu/rope_kernels.h"
#include "cpu/silu_mul_kernels.h"
#include "cpu/vec_kernels.h"
#pragma GCC pop_options
#undef __AVX__
#undef __AVX2__
#undef __FMA__
#undef __F16C__
#endif
