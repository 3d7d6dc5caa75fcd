// Launcher of the softmax / log_softmax kernels (torch-free; kernels/softmax.cu).
#pragma once

#include <cuda_runtime.h>

#include "kernels/row_layout.h"

namespace mti {

// Each row of `layout` <- softmax(z) (log_softmax(z) when params.log) with
// z = x * params.scale, plus the mask: mask_layout.kind kBool: `mask` holds bytes, nonzero =
// takes part, others get z = -inf; kAdditive: `mask` holds T values added to z (-inf masks
// too); kNone: `mask` is unused. params.causal additionally masks column j of row r when
// j > r % params.q_len. Masked elements become 0 (-inf for log_softmax); a row in which
// nothing takes part becomes all zeros. Float32, float16 and bfloat16 (explicitly
// instantiated), fp32 arithmetic. Returns cudaGetLastError() after the launch.
template <typename T>
cudaError_t launch_softmax(T* x, const RowLayout& layout, const void* mask,
                           const MaskLayout& mask_layout, const SoftmaxParams& params,
                           cudaStream_t stream);

}  // namespace mti
