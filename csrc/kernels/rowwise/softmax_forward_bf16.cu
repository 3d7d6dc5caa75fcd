#include "kernels/rowwise/softmax_forward.cuh"

namespace mti {
MTI_INSTANTIATE_SOFTMAX_FORWARD(__nv_bfloat16)
}  // namespace mti
