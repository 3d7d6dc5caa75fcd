// Torch-free and CUDA-free description of a rope_ / rope_backward call, shared by the host code
// that plans it (common/plans.*), the CPU kernel and the CUDA kernel.
#pragma once

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti {

// Rows of D = 2 * half elements, each rotated as two halves. Every tensor keeps its own row
// indexer over one row numbering: `in` is read, `out` written (the same rows as `in` in the
// forward, which writes over x), cos and sin are broadcast to in's shape (stride 0 on the dims
// they broadcast over). Within a row every tensor's elements are contiguous (stride 1).
struct RopeLayout {
  int64_t rows = 0;
  int64_t half = 0;
  RowIndexer in, out, cos, sin;
  bool out_is_in = false;  // out's offsets are in's (one offset computed per row)
};

}  // namespace mti
