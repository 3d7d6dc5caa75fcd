// silu_mul_backward_ on CUDA (declared in silu_mul.h): an elementwise pass that reads grad,
// gate and up once and writes both gradients over gate and up. Arrays whose starts are
// 16-byte aligned move 16 bytes per access (the last n % VEC elements one by one); others run
// the same kernel one element per access. One thread per vector, no striding: a grid-stride
// loop at 4-16 CTAs an SM ran 5-15% slower on the H200 (one set of loads in flight a thread).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/row_layout.h"
#include "kernels/silu_mul/silu_mul.h"
#include "kernels/silu_mul/tuning.h"

namespace mti {
namespace {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// The two gradients of one element, computed in A (float, or double for double): with
// s = sigmoid(gate), up <- grad * gate * s, gate <- grad * up * s * (1 + gate * (1 - s)).
template <typename T>
__device__ __forceinline__ void silu_mul_grads(T grad, T& gate, T& up) {
  using A = acc_type_t<T>;
  const A d = to_acc(grad), g = to_acc(gate), u = to_acc(up);
  const A s = A(1) / (A(1) + exp(-g));
  up = from_acc<T>(d * g * s);
  gate = from_acc<T>(d * u * s * (A(1) + g * (A(1) - s)));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kSiluMulThreads)
    silu_mul_backward_kernel(const T* __restrict__ grad, T* __restrict__ gate, T* __restrict__ up,
                             int64_t n) {
  const int64_t vectors = n / VEC;
  const int64_t k = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (k < vectors) {
    const Vec<T, VEC> d = reinterpret_cast<const Vec<T, VEC>*>(grad)[k];
    Vec<T, VEC> g = reinterpret_cast<const Vec<T, VEC>*>(gate)[k];
    Vec<T, VEC> u = reinterpret_cast<const Vec<T, VEC>*>(up)[k];
#pragma unroll
    for (int j = 0; j < VEC; ++j) silu_mul_grads(d.v[j], g.v[j], u.v[j]);
    reinterpret_cast<Vec<T, VEC>*>(gate)[k] = g;
    reinterpret_cast<Vec<T, VEC>*>(up)[k] = u;
  } else {
    // Threads past the vectors take the last n % VEC elements, one each.
    const int64_t i = vectors * VEC + (k - vectors);
    if (i < n) silu_mul_grads(grad[i], gate[i], up[i]);
  }
}

template <typename T, int VEC>
cudaError_t launch(const T* grad, T* gate, T* up, int64_t n, cudaStream_t stream) {
  const int64_t threads = n / VEC + n % VEC;
  silu_mul_backward_kernel<T, VEC>
      <<<static_cast<unsigned>(ceil_div(threads, int64_t{kSiluMulThreads})), kSiluMulThreads, 0,
         stream>>>(grad, gate, up, n);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_silu_mul_backward(const T* grad, T* gate, T* up, int64_t n,
                                     cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  if (ptr_aligned(grad, 16) && ptr_aligned(gate, 16) && ptr_aligned(up, 16))
    return launch<T, kVec>(grad, gate, up, n, stream);
  return launch<T, 1>(grad, gate, up, n, stream);
}

#define MTI_INSTANTIATE(T) \
  template cudaError_t launch_silu_mul_backward<T>(const T*, T*, T*, int64_t, cudaStream_t);
MTI_FOR_EACH_DTYPE(MTI_INSTANTIATE)
#undef MTI_INSTANTIATE

}  // namespace mti
