// Shared by the CUDA host functions: dtype dispatch and the mapping from ATen's scalar types
// to the CUDA types the torch-free kernels in csrc/kernels/ are written in.
//
// Every host function opens with the same two lines:
//   const c10::cuda::CUDAGuard guard(x.device());
//   const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
// and wraps every kernel launcher (which returns cudaGetLastError() after its launches) in
// C10_CUDA_CHECK.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mti::cuda {

template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<at::Half> {
  using type = __half;
};
template <>
struct DeviceType<at::BFloat16> {
  using type = __nv_bfloat16;
};

// t's data as the kernels' element type (at::Half and __half share one layout, likewise bf16).
template <typename scalar_t>
typename DeviceType<scalar_t>::type* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename DeviceType<scalar_t>::type*>(t.data_ptr<scalar_t>());
}

// The same for a tensor the kernel only reads.
template <typename scalar_t>
const typename DeviceType<scalar_t>::type* const_device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const typename DeviceType<scalar_t>::type*>(t.const_data_ptr<scalar_t>());
}

}  // namespace mti::cuda

// Runs the lambda body with scalar_t bound to float, at::Half or at::BFloat16.
#define MTI_DISPATCH_FLOATING(TYPE, NAME, ...)                               \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                             \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)    \
                         AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__) \
                             AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
