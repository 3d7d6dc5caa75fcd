#include "kernels/rowwise/softmax_backward.cuh"

namespace mti {
MTI_INSTANTIATE_SOFTMAX_BACKWARD(__nv_bfloat16)
}  // namespace mti
