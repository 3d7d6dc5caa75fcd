#include "kernels/rowwise/norm_backward.cuh"

namespace mti {
MTI_INSTANTIATE_NORM_BACKWARD(float)
}  // namespace mti
