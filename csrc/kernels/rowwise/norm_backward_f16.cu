#include "kernels/rowwise/norm_backward.cuh"

namespace mti {
MTI_INSTANTIATE_NORM_BACKWARD(__half)
}  // namespace mti
