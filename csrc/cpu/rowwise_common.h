// Shared by the CPU row-wise kernels (rowwise.cpp, rowwise_backward.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>

namespace mti::cpu {

// Rows per parallel task: enough elements that a task outweighs its scheduling.
inline int64_t grain_rows(int64_t n) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
}

template <typename scalar_t>
const scalar_t* optional_data(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<scalar_t>() : nullptr;
}

}  // namespace mti::cpu

#define MTI_CPU_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)
