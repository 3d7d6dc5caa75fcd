#include "kernels/rowwise/softmax_forward.cuh"

namespace mti {
MTI_INSTANTIATE_SOFTMAX_FORWARD(float)
}  // namespace mti
