// Launcher of silu_mul_backward_'s kernel (torch-free). Float32, float16, bfloat16 and float64
// (explicitly instantiated in silu_mul.cu); fp32 arithmetic, double for float64.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mti {

// For each of the n elements, with s = sigmoid(gate): up <- grad * gate * s and
// gate <- grad * up * s * (1 + gate * (1 - s)), the gradients of silu(gate) * up for grad,
// each rounded once to T. Contiguous arrays that overlap nowhere. One kernel on `stream`;
// returns the launch's error.
template <typename T>
cudaError_t launch_silu_mul_backward(const T* grad, T* gate, T* up, int64_t n, cudaStream_t stream);

}  // namespace mti
