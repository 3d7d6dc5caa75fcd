// The silu_mul_backward_ kernel's GPU-dependent choices (compile-time).
#pragma once

namespace mti {

// CTA size: 8 warps; the grid has one thread per 16-byte vector.
constexpr int kSiluMulThreads = 256;

}  // namespace mti
