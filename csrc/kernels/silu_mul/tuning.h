// The silu_mul_backward_ kernel's GPU-dependent choices (compile-time).
#pragma once

namespace mti {

// CTA size: 8 warps, several CTAs an SM.
constexpr int kSiluMulThreads = 256;
// CTAs of the grid per SM, each striding over the vectors: enough loads in flight to cover
// DRAM latency (8 x 256 threads x 3 loads of 16 bytes an SM) without a CTA per vector.
constexpr int kSiluMulCtasPerSm = 8;

}  // namespace mti
