#include "kernels/rowwise/softmax_backward.cuh"

namespace mti {
MTI_INSTANTIATE_SOFTMAX_BACKWARD(float)
}  // namespace mti
