// Torch-free and CUDA-free description of a cross_entropy_ call, shared by the host code that
// plans it (common/plans.*), the CPU kernel and the CUDA kernel.
#pragma once

#include <cstdint>

namespace mti {

// at::Reduction's values.
enum class CrossEntropyReduction : int { kNone = 0, kMean = 1, kSum = 2 };

struct CrossEntropyParams {
  int64_t ignore_index = -100;  // rows with this target: loss 0, gradient 0
  CrossEntropyReduction reduction = CrossEntropyReduction::kMean;
  double label_smoothing = 0.0;  // eps: the target distribution is (1 - eps) onehot + eps / V
};

}  // namespace mti
