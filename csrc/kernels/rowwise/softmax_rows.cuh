// What the forward and backward softmax ops share: how a row is scaled and masked
// (softmax_forward.cu, softmax_backward.cu).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/row_layout.h"
#include "kernels/rowwise/framework.cuh"

namespace mti {

template <MaskKind kMask>
struct SoftmaxRows {
  // A bool mask is read as bytes, an additive one in x's dtype (the caller passes T).
  template <typename T>
  using MaskOf = std::conditional_t<kMask == MaskKind::kBool, uint8_t, T>;

  const void* mask = nullptr;
  RowIndexer mask_rows;
  int64_t mask_col_stride = 0;  // 1 whenever VEC > 1
  float scale = 1.f;
  bool log = false;
  bool causal = false;
  int64_t q_len = 1;
  int64_t n = 0;

  SoftmaxRows() = default;
  SoftmaxRows(const void* mask_data, const MaskLayout& mask_layout, const SoftmaxParams& params,
              int64_t row_n)
      : mask(mask_data),
        mask_rows(mask_layout.row),
        mask_col_stride(mask_layout.col_stride),
        scale(params.scale),
        log(params.log),
        causal(params.causal),
        q_len(params.q_len),
        n(row_n) {}

  // Columns from this one on are causally masked in row r (n: none).
  __device__ __forceinline__ int64_t causal_limit(int64_t r) const {
    if (!causal) return n;  // before the 64-bit modulo, which the compiler would not skip
    const int64_t keep = r % q_len + 1;
    return keep < n ? keep : n;
  }

  // Whether the mask (if any) can be read by vectors of kVec<T> elements.
  template <typename T>
  bool mask_vectors_aligned() const {
    using M = MaskOf<T>;
    return kMask == MaskKind::kNone ||
           (mask_col_stride == 1 && rows_aligned(mask, mask_rows, sizeof(M), sizeof(M) * kVec<T>));
  }

  // Row r's mask values (nullptr without a mask).
  template <typename T>
  __device__ __forceinline__ const MaskOf<T>* mask_row(int64_t r) const {
    if constexpr (kMask == MaskKind::kNone) return nullptr;
    return static_cast<const MaskOf<T>*>(mask) + mask_rows.offset(r);
  }
};

}  // namespace mti
