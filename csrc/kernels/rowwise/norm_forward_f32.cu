#include "kernels/rowwise/norm_forward.cuh"

namespace mti {
MTI_INSTANTIATE_NORMS(float)
}  // namespace mti
