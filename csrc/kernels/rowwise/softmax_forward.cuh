// softmax / log_softmax over rows, written over the input: the op functor for the forward
// kernel (forward.cuh), and its launcher.
// Instantiated once per dtype, in softmax_forward_{f32,f16,bf16}.cu, which the build compiles in
// parallel.
#pragma once
#include "kernels/rowwise/rowwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/rowwise/forward.cuh"
#include "kernels/rowwise/softmax_rows.cuh"

namespace mti {
namespace {

// (m, s) = (max of a set of values, sum of exp(value - m)). One reduction carries both, so a
// row needs a single pass of communication between threads.
struct MaxSum {
  float m, s;

  static __device__ __forceinline__ MaxSum identity() { return {-INFINITY, 0.f}; }

  // The max a set's sum is taken relative to: a set whose max is -inf holds only masked
  // elements (or NaN), and is taken relative to 0 so that its sum stays 0 (or NaN) instead of
  // exp(-inf - -inf) = NaN.
  static __device__ __forceinline__ float shift(float m) { return m == -INFINITY ? 0.f : m; }

  // One exp per merge: the side that holds the max keeps its sum as it is (its factor would
  // be exp(0) = 1 exactly), so only the other side is rescaled. Swapping a and b takes the
  // other branch with the same operands, so the bits do not depend on the order; with equal
  // maxima both branches add a.s and b.s (the factor is exactly 1). _rn intrinsics: no FMA
  // contraction that could differ between the two branches (see reduce.cuh).
  // expf, not __expf: partial sums of fp32 rows need it, and it runs once per merge.
  static __device__ __forceinline__ MaxSum combine(const MaxSum& a, const MaxSum& b) {
    const float m = fmaxf(a.m, b.m);
    const bool a_holds_max = a.m == m;
    const MaxSum& low = a_holds_max ? b : a;
    const float factor = expf(low.m - shift(m));
    return {m, __fadd_rn(a_holds_max ? a.s : b.s, __fmul_rn(low.s, factor))};
  }

  template <class F>
  __device__ __forceinline__ MaxSum map(F f) const {
    return {f(m), f(s)};
  }

  // The threads' chunks in two butterflies, the max and then the sums rescaled to it (an exp
  // per thread), instead of log2(width) merges of an exp each. As in combine(), the chunk
  // that holds the max adds its sum as it is.
  static __device__ __forceinline__ MaxSum allreduce_chunks(const MaxSum& c, int width) {
    const float m = warp_allreduce(MaxState{c.m}, width).v;
    const float factor = c.m == m ? 1.f : expf(c.m - shift(m));
    return {m, warp_allreduce(Sum{__fmul_rn(c.s, factor)}, width).v};
  }
};

template <typename T, MaskKind kMask>
struct SoftmaxOp : SoftmaxRows<kMask> {
  using Rows = SoftmaxRows<kMask>;
  using Rows::log;
  using Rows::mask_col_stride;
  using Rows::scale;
  using State = MaxSum;
  using MaskT = typename Rows::template MaskOf<T>;
  static constexpr const Tunable& kCtaRowValues = kSoftmaxCtaRowValues;
  static constexpr const Tunable& kRowsPerCta = kSoftmaxRowsPerCta;
  // An unread column (causal limit, past the end) is a masked one.
  static constexpr float kPad = -INFINITY;
  static constexpr bool kKeepsX = false;  // prepare() scales and masks z, local() exps it
  static constexpr int kParams = 0;
  ColumnParams<T, 0> params;
  // Per vector: the additive mask's values, or the bool mask's bytes as one integer (kept
  // packed: a byte per register would crowd out the row).
  template <int VEC>
  using BoolWord =
      std::conditional_t<VEC == 8, uint64_t, std::conditional_t<VEC == 4, uint32_t, uint8_t>>;
  template <int VEC>
  using Aux = std::conditional_t<
      kMask == MaskKind::kNone, NoAux,
      std::conditional_t<kMask == MaskKind::kBool, BoolWord<VEC>, Packed<MaskT, VEC>>>;

  struct Row {
    int64_t load_end;  // causal rows read only the columns j <= r % q_len
    const MaskT* mask;
  };

  __device__ __forceinline__ Row row(int64_t r, const T*) const {
    return {this->causal_limit(r), this->template mask_row<T>(r)};
  }

  template <int VEC>
  __device__ __forceinline__ void load_aux(Aux<VEC>& a, const Row& rc, int64_t c0, int cnt) const {
    // A bool mask is usually broadcast over the batch (and heads): kept in L2 for the rows
    // that share it. (Not the additive one: its vectors are as wide as x's, and the largest
    // kernels then spilled on sm_80 and sm_90a.)
    if constexpr (kMask == MaskKind::kAdditive) {
      a = cnt > 0 ? load_vec<VEC>(rc.mask, c0, mask_col_stride) : Aux<VEC>{};
    } else if constexpr (kMask == MaskKind::kBool) {
      static_assert(sizeof(Aux<VEC>) == VEC, "one mask byte per element");
      if constexpr (VEC == 1)
        a = cnt > 0 ? load_keep_in_l2(rc.mask + c0 * mask_col_stride) : 0;
      else
        a = cnt > 0 ? load_keep_in_l2(reinterpret_cast<const Aux<VEC>*>(rc.mask + c0)) : 0;
    }
  }

  template <int VEC>
  __device__ __forceinline__ void prepare(float (&v)[VEC], const Aux<VEC>& a, const Row&,
                                          int cnt) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (j < cnt) {
        float z = v[j] * scale;
        if constexpr (kMask == MaskKind::kBool) z = ((a >> (8 * j)) & 0xff) != 0 ? z : -INFINITY;
        if constexpr (kMask == MaskKind::kAdditive) z += to_float(a.v[j]);
        v[j] = z;
      }
    }
  }

  // softmax keeps e = exp(z - chunk max) in place of z, so that writing costs a multiply
  // instead of a second exp; log_softmax keeps z.
  template <int NV, int VEC, class Valid>
  __device__ __forceinline__ MaxSum local(float (&z)[NV][VEC], const Row&, Valid) const {
    const float m = fold<NV * VEC>([&](int i) { return z[i / VEC][i % VEC]; }, Max{});
    const float ms = MaxSum::shift(m);
    if constexpr (sizeof(T) == 2 && VEC > 1) {
      // The exps by with_exp_for, from the chunk's smallest z. Not on the scalar path (VEC 1),
      // where the second loop cost up to 50 registers with a mask. Masked elements (-inf) give
      // exactly 0 on both paths, so with a mask the min skips them: a mask leaves -inf in nearly
      // every chunk, which would otherwise always take the __expf loop (without one, -inf is only
      // the padding of a row's last chunk). v + v * 0 is v, but NaN for -inf, and fminf skips
      // NaN: one FMA per element (a compare and select made the bf16 bool-mask kernel spill on
      // sm_90).
      const float lo = fold<NV * VEC>(
          [&](int i) {
            const float v = z[i / VEC][i % VEC];
            return kMask == MaskKind::kNone ? v : __fmaf_rn(v, 0.f, v);
          },
          Min{});
      // Chosen for the whole warp: the bits are the same either way.
      return {m, with_exp_for<T>(warp_all(no_subnormal_exps(lo - ms)),
                                 [&](auto exp) { return exp_sum(z, ms, exp); })};
    }
    return {m, exp_sum(z, ms, [](float d) { return exp_for<T>(d); })};
  }

  // The sum of exp(z - ms) over a chunk; softmax keeps each exp in z.
  template <int NV, int VEC, class Exp>
  __device__ __forceinline__ float exp_sum(float (&z)[NV][VEC], float ms, Exp exp) const {
    return fold<NV * VEC>(
        [&](int i) {
          const float e = exp(z[i / VEC][i % VEC] - ms);
          if (!log) z[i / VEC][i % VEC] = e;
          return e;
        },
        Add{});
  }

  struct Fin {
    float m;
    float inv_s;  // softmax
    float log_s;  // log_softmax
    bool empty;   // nothing in the row takes part
  };

  __device__ __forceinline__ Fin finish(const MaxSum& t, const Row&) const {
    Fin f;
    f.m = t.m;
    f.empty = t.m == -INFINITY && t.s == 0.f;
    // log1pf keeps log(s) accurate for s near 1, i.e. for the largest outputs of a peaked row.
    f.log_s = log ? log1pf(t.s - 1.f) : 0.f;
    f.inv_s = log ? 0.f : __frcp_rn(t.s);
    return f;
  }

  struct Out {
    float factor;  // softmax: y = e * factor
    Fin fin;
  };

  __device__ __forceinline__ Out out(const Fin& f, const MaxSum& chunk) const {
    Out o;
    o.fin = f;
    // A chunk whose elements are all masked has e = 0 (or NaN); keep it 0 without computing
    // exp(-inf - m). A NaN sum still reaches every element through inv_s.
    o.factor =
        log || f.empty ? 0.f : (chunk.m == -INFINITY ? 0.f : exp_for<T>(chunk.m - f.m)) * f.inv_s;
    return o;
  }

  template <int VEC>
  __device__ __forceinline__ void output(float (&v)[VEC], const Out& o,
                                         const ParamValues<0, VEC>&) const {
    // One branch on `log` per vector: written as a select per element, it compiled to a
    // branch and reconvergence per element (4 instructions where softmax needs 1).
    if (!log) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] *= o.factor;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = o.fin.empty ? 0.f : (v[j] - o.fin.m) - o.fin.log_s;
    }
  }

  __device__ __forceinline__ void save(int64_t, const Fin&) const {}
};

template <typename T, MaskKind kMask>
cudaError_t launch_masked(T* x, const RowLayout& layout, const void* mask,
                          const MaskLayout& mask_layout, const SoftmaxParams& params,
                          cudaStream_t stream) {
  const SoftmaxOp<T, kMask> op{{mask, mask_layout, params, layout.n}};
  // Vector accesses need x's rows and the mask's rows (if any) aligned to a vector.
  const bool aligned = layout.col_stride == 1 && rows_aligned(x, layout.row, sizeof(T), 16) &&
                       op.template mask_vectors_aligned<T>();
  return launch_rows(x, layout, op, aligned, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_softmax(T* x, const RowLayout& layout, const void* mask,
                           const MaskLayout& mask_layout, const SoftmaxParams& params,
                           cudaStream_t stream) {
  switch (mask_layout.kind) {
    case MaskKind::kBool:
      return launch_masked<T, MaskKind::kBool>(x, layout, mask, mask_layout, params, stream);
    case MaskKind::kAdditive:
      return launch_masked<T, MaskKind::kAdditive>(x, layout, mask, mask_layout, params, stream);
    case MaskKind::kNone:
      break;
  }
  return launch_masked<T, MaskKind::kNone>(x, layout, mask, mask_layout, params, stream);
}

#define MTI_INSTANTIATE_SOFTMAX_FORWARD(T)                                                     \
  template cudaError_t launch_softmax<T>(T*, const RowLayout&, const void*, const MaskLayout&, \
                                         const SoftmaxParams&, cudaStream_t);

}  // namespace mti
