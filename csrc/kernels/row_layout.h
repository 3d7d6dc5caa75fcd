// Torch-free description of "a tensor seen as rows": shared by the CPU kernels, the CUDA
// kernels and the host code that builds it from an at::Tensor (csrc/common/layout.h).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MTI_HD __host__ __device__ __forceinline__
#else
#define MTI_HD inline
#endif

namespace mti {

// Leading dims that stay after merging the mergeable ones; more than this is refused.
constexpr int kMaxLeadDims = 8;

// Maps a logical row number (row-major order over the tensor's leading dims, i.e. the order
// of x.reshape(-1, N)) to the element offset of that row's first element. Rows are
// enumerated logically, so the causal mask can read the query index as row % q_len whatever
// the memory layout.
struct RowIndexer {
  int ndim = 0;                        // 0: every row starts at offset 0 (a single row)
  int64_t sizes[kMaxLeadDims] = {};    // outermost first
  int64_t strides[kMaxLeadDims] = {};  // in elements; 0 for a broadcast (mask) dim

  // row must be in [0, product of sizes).
  MTI_HD int64_t offset(int64_t row) const {
    if (ndim <= 1) return row * strides[0];  // the common, fully merged case (0: strides 0)
    // Kernels compute this once per row and thread (several times with a broadcast mask,
    // which keeps x's dims from merging too), so its divisions count: 64-bit division is a
    // long instruction sequence on a GPU, 32-bit division a few times shorter. Below 2^32
    // the row number, and every quotient of it, divide in 32 bits.
    bool narrow = row <= UINT32_MAX;
    for (int i = 1; i < ndim; ++i) narrow = narrow && sizes[i] <= UINT32_MAX;
    return narrow ? offset_as<uint32_t>(static_cast<uint32_t>(row)) : offset_as<int64_t>(row);
  }

 private:
  // Innermost dim first; the outermost takes what is left of row, which is below its size.
  template <typename I>
  MTI_HD int64_t offset_as(I row) const {
    int64_t off = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int i = kMaxLeadDims - 1; i > 0; --i) {
      if (i < ndim) {
        const I size = static_cast<I>(sizes[i]);
        off += static_cast<int64_t>(row % size) * strides[i];
        row /= size;
      }
    }
    return off + static_cast<int64_t>(row) * strides[0];
  }
};

// Whether p is a multiple of `align` (nullptr is).
inline bool ptr_aligned(const void* p, int64_t align) {
  return reinterpret_cast<uintptr_t>(p) % align == 0;
}

// Whether `base + rows.offset(r) * elem_bytes` is a multiple of `align` for every row r.
inline bool rows_aligned(const void* base, const RowIndexer& rows, int64_t elem_bytes,
                         int64_t align) {
  if (!ptr_aligned(base, align)) return false;
  for (int i = 0; i < rows.ndim; ++i)
    if (rows.sizes[i] > 1 && (rows.strides[i] * elem_bytes) % align != 0) return false;
  return true;
}

// x seen as `rows` rows of `n` elements each.
struct RowLayout {
  int64_t rows = 0;
  int64_t n = 0;
  RowIndexer row;          // row -> offset of its first element
  int64_t col_stride = 1;  // distance between neighbours in a row (1 on every fast path)
};

// A backward pass's rows: y and grad read, grad_x written, each tensor with its own layout
// (same rows and n).
struct BackwardRows {
  RowLayout y, grad, grad_x;
};

enum class MaskKind : int { kNone = 0, kBool = 1, kAdditive = 2 };

// A mask broadcast to x's shape, walked with x's row numbering.
struct MaskLayout {
  MaskKind kind = MaskKind::kNone;
  RowIndexer row;
  int64_t col_stride = 0;
};

struct SoftmaxParams {
  float scale = 1.f;    // z = x * scale (+ additive mask) before the softmax
  bool log = false;     // log_softmax instead of softmax
  bool causal = false;  // element (i, j) of the last two dims takes part only if j <= i
  int64_t q_len = 1;    // size of dim -2; the query index of a row is row % q_len
};

}  // namespace mti
