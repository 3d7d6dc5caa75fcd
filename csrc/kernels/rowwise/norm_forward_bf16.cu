#include "kernels/rowwise/norm_forward.cuh"

namespace mti {
MTI_INSTANTIATE_NORMS(__nv_bfloat16)
}  // namespace mti
