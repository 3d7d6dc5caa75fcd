// Small device helpers shared by every kernel in csrc/kernels/ (no torch here).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mti {

// Conversions between the storage types and the fp32 the kernels accumulate in.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// exp as accurate as the output type needs: __expf's relative error grows with |x| (about
// |x| * 2^-22), invisible once rounded to bf16/fp16 but several times PyTorch's error in fp32,
// where the accurate expf is used.
template <typename T>
__device__ __forceinline__ float exp_for(float x) {
  return __expf(x);
}
template <>
__device__ __forceinline__ float exp_for<float>(float x) {
  return expf(x);
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace mti
