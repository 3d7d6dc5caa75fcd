// Launcher of the cross_entropy_ kernels (torch-free): per-row losses, and logits overwritten
// with their gradient. Float32, float16, bfloat16 and float64 (explicitly instantiated in
// cross_entropy.cu); fp32 arithmetic, double for float64.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cross_entropy/params.h"
#include "kernels/row_layout.h"

namespace mti {

// The type of the losses and of the arithmetic: double for double logits, else float.
template <typename T>
using cross_entropy_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Two kernels on `stream`, no host synchronisation. The first reads the `rows` int64 values of
// `target` (contiguous), counts those that are not params.ignore_index into *valid_rows (one
// zeroed here) and, on a target outside [0, n) that is not ignore_index, prints it and fails a
// device-side assert, before the second kernel can write a byte. The second, per row of
// `layout`: losses[r] <- ((1 - eps) (lse - x[t]) + eps (lse - mean(x))) * scale and
// x <- (softmax(x) - (1 - eps) onehot(t) - eps / n) * scale, with eps = label_smoothing and
// scale = 1 / *valid_rows for kMean, else 1; rows with target ignore_index get loss 0 (times
// scale: NaN where no row is valid under kMean) and gradient 0.
template <typename T>
cudaError_t launch_cross_entropy(T* logits, const RowLayout& layout, const int64_t* target,
                                 const CrossEntropyParams& params, cross_entropy_acc_t<T>* losses,
                                 unsigned long long* valid_rows, cudaStream_t stream);

}  // namespace mti
