#include "kernels/rowwise/softmax_forward.cuh"

namespace mti {
MTI_INSTANTIATE_SOFTMAX_FORWARD(__half)
}  // namespace mti
