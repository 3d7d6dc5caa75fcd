// LayerNorm and RMSNorm over rows, written over the input: the op functors for the forward
// kernel (forward.cuh), and their launchers.
// Instantiated once per dtype, in norm_forward_{f32,f16,bf16}.cu, which the build compiles in
// parallel.
#pragma once
#include "kernels/rowwise/rowwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/rowwise/forward.cuh"

namespace mti {
namespace {

// (count, mean, sum of squared deviations from the mean) of a set of values. Each thread's
// chunk is reduced in two passes over its registers, chunks are merged with Chan et al.'s
// pairwise update; both stay accurate when |mean| >> std, unlike sums of x and x^2.
struct MeanM2 {
  float n, mean, m2;

  static __device__ __forceinline__ MeanM2 identity() { return {0.f, 0.f, 0.f}; }

  static __device__ __forceinline__ MeanM2 combine(const MeanM2& a, const MeanM2& b) {
    if (a.n == 0.f) return b;
    if (b.n == 0.f) return a;
    // mean = a.mean + delta * b.n / n, written symmetrically in (a, b) as the midpoint plus a
    // correction, and with _rn intrinsics against FMA contraction: the bits must not depend
    // on the argument order (see reduce.cuh). The midpoint keeps the rounding error
    // at that of the mean itself, where n_a*mean_a + n_b*mean_b would add that of the sums.
    const float n = __fadd_rn(a.n, b.n);
    const float delta = __fsub_rn(b.mean, a.mean);
    const float inv_n = __fdividef(1.f, n);
    const float mid = __fmul_rn(0.5f, __fadd_rn(a.mean, b.mean));
    const float skew = __fmul_rn(__fmul_rn(0.5f, __fsub_rn(b.n, a.n)), inv_n);
    const float mean = __fadd_rn(mid, __fmul_rn(skew, delta));
    const float m2 =
        __fadd_rn(__fadd_rn(a.m2, b.m2),
                  __fmul_rn(__fmul_rn(delta, delta), __fmul_rn(__fmul_rn(a.n, b.n), inv_n)));
    return {n, mean, m2};
  }

  template <class F>
  __device__ __forceinline__ MeanM2 map(F f) const {
    return {f(n), f(mean), f(m2)};
  }

  // The threads' chunks (few values each) in two butterflies of sums instead of log2(width)
  // of combine() (a division and two branches each): n and the sum, whence the mean; then
  // m2 about that mean, each chunk adding its m2 and n * (its mean - the mean)^2. A chunk of
  // equal values has exactly their value as mean (see LayerNormOp::local), and a warp's sums
  // of n * mean stay exact for them (chunks in registers: at most 2048 values of 16-bit
  // precision per warp, 22 bits), so a row of equal values keeps its exact mean and an m2 of 0, as
  // combine() keeps them.
  static __device__ __forceinline__ MeanM2 allreduce_chunks(const MeanM2& s, int width) {
    const Sum2<float> t = warp_allreduce(Sum2<float>{s.n * s.mean, s.n}, width);
    if (t.b == 0.f) return identity();
    const float inv = __fdividef(1.f, t.b);
    float mean = t.a * inv;
    mean = fmaf(fmaf(-mean, t.b, t.a), inv, mean);
    const float d = s.mean - mean;
    const Sum m2 = warp_allreduce(Sum{fmaf(s.n * d, d, s.m2)}, width);
    return {t.b, mean, m2.v};
  }
};

// The exact sum a + b as an unevaluated hi + lo (Knuth's TwoSum). _rn against contraction.
__device__ __forceinline__ float two_sum(float a, float b, float& err) {
  const float s = __fadd_rn(a, b);
  const float bb = __fsub_rn(s, a);
  err = __fadd_rn(__fsub_rn(a, __fsub_rn(s, bb)), __fsub_rn(b, bb));
  return s;
}

// A count and an exact sum carried as an unevaluated hi + lo: TwoSum's error is exact, so the
// merge is symmetric in (a, b) to the bit, as reduce.cuh needs.
struct CountSum {
  float n, hi, lo;

  static __device__ __forceinline__ CountSum identity() { return {0.f, 0.f, 0.f}; }
  static __device__ __forceinline__ CountSum combine(const CountSum& a, const CountSum& b) {
    float err;
    const float hi = two_sum(a.hi, b.hi, err);
    return {__fadd_rn(a.n, b.n), hi, __fadd_rn(__fadd_rn(a.lo, b.lo), err)};
  }
  template <class F>
  __device__ __forceinline__ CountSum map(F f) const {
    return {f(n), f(hi), f(lo)};
  }
};

// MeanM2 relative to a pivot, with the sum of x - pivot carried as hi + lo instead of the
// mean. A mean relative to the pivot rounds at |mean - pivot|, which exceeds |mean| when the
// pivot is an outlier (its weight gradient then erred several times PyTorch's error). Sums
// add exactly as a TwoSum, so the mean is then rounded once, in finish(), at its own
// magnitude. m2's merges take each part's mean from hi alone: an error e in the difference
// delta of two means adds about 2 delta e n_a n_b / n to m2, first order in e, so hi must
// hold the part's sum to about its own rounding, which it does as long as local() sums
// x - pivot (summing x itself left the rounding at |x| in hi, and rows at a large offset got
// rstd off by twice PyTorch's error).
struct PivotSums {
  float n, hi, lo, m2;

  static __device__ __forceinline__ PivotSums identity() { return {0.f, 0.f, 0.f, 0.f}; }

  static __device__ __forceinline__ PivotSums combine(const PivotSums& a, const PivotSums& b) {
    if (a.n == 0.f) return b;
    if (b.n == 0.f) return a;
    const CountSum s = CountSum::combine({a.n, a.hi, a.lo}, {b.n, b.hi, b.lo});
    const float delta = __fsub_rn(__fdividef(b.hi, b.n), __fdividef(a.hi, a.n));
    const float m2 =
        __fadd_rn(__fadd_rn(a.m2, b.m2),
                  __fmul_rn(__fmul_rn(delta, delta), __fdividef(__fmul_rn(a.n, b.n), s.n)));
    return {s.n, s.hi, s.lo, m2};
  }

  template <class F>
  __device__ __forceinline__ PivotSums map(F f) const {
    return {f(n), f(hi), f(lo), f(m2)};
  }

  // The threads' chunks in two butterflies, as MeanM2's: the count and the exact sum (no
  // division, no branch), then m2 about the mean those give, each chunk adding its m2 and
  // n * (its mean - that mean)^2. The row's mean need only be rough: its error e adds n e^2
  // to m2 (the chunks' deviations from the exact mean sum to 0); each chunk's own mean must
  // be as good as in combine().
  static __device__ __forceinline__ PivotSums allreduce_chunks(const PivotSums& s, int width) {
    const CountSum t = warp_allreduce(CountSum{s.n, s.hi, s.lo}, width);
    if (t.n == 0.f) return identity();
    const float d = s.n == 0.f ? 0.f : __fdividef(s.hi, s.n) - __fdividef(t.hi, t.n);
    const Sum m2 = warp_allreduce(Sum{fmaf(s.n * d, d, s.m2)}, width);
    return {t.n, t.hi, t.lo, m2.v};
  }
};

// What LayerNorm and RMSNorm share: statistics folded into one rstd per row that may be
// saved, K per-column params (weight; LayerNorm's bias).
template <typename T, class S, int K>
struct NormOpBase {
  using State = S;
  static constexpr float kPad = 0.f;
  static constexpr bool kKeepsX = true;  // prepare() and local() change no z
  static constexpr int kParams = K;
  template <int VEC>
  using Aux = NoAux;

  ColumnParams<T, K> params;
  float* rstd_out;
  float eps;
  int64_t n;

  template <int VEC, class Row>
  __device__ __forceinline__ void load_aux(Aux<VEC>&, const Row&, int64_t, int) const {}

  template <class Fin>
  __device__ __forceinline__ const Fin& out(const Fin& f, const S&) const {
    return f;
  }
  template <class Fin>
  __device__ __forceinline__ void save(int64_t r, const Fin& f) const {
    if (rstd_out != nullptr) rstd_out[r] = f.rstd;
  }

  // 1 / sqrt(sq / n + eps) for a row's sum of squares (about its mean for LayerNorm), once
  // per row; correctly rounded (not the 2-ulp __fdividef / rsqrtf), since the backward
  // recovers x_hat from y and reads rstd. An fp32 row computes it in double: the quotient's
  // and the sum's roundings in fp32 put rstd a further ulp off, which an fp32 output shows.
  __device__ __forceinline__ float rstd_of(float sq) const {
    if constexpr (sizeof(T) == 4)
      return static_cast<float>(1.0 / sqrt(fmax(static_cast<double>(sq) / n, 0.0) + eps));
    else
      return __frsqrt_rn(fmaxf(sq / static_cast<float>(n), 0.f) + eps);
  }
};

// fp32 rows are reduced relative to a pivot (see LayerNormOp::kPivot), 16-bit rows not.
template <typename T>
using LayerNormState = std::conditional_t<sizeof(T) == 4, PivotSums, MeanM2>;

template <typename T>
struct LayerNormOp : NormOpBase<T, LayerNormState<T>, 2> {
  static constexpr const Tunable& kCtaRowValues = kLayerNormCtaRowValues;
  static constexpr const Tunable& kRowsPerCta = kLayerNormRowsPerCta;
  // An fp32 row is reduced relative to its first element (the pivot): with a large common
  // offset the statistics then keep their precision, and the mean never has to be rounded at
  // the offset's magnitude. local() subtracts the pivot on the fly and output() subtracts
  // pivot + mean as an exact sum from x itself: normalizing a rounded x - pivot adds a
  // rounding of the size of x - pivot, several times PyTorch's error. A 16-bit row needs no
  // pivot: unless they are all equal, its values are at most
  // 2^8 (bf16) or 2^11 (fp16) times their spread (max - min), so the fp32 mean's rounding at
  // the offset's magnitude stays far below a 16-bit output's; equal values have exactly
  // their value as mean (see local()); without it a 16-bit row saves a load and a
  // subtraction per element.
  static constexpr bool kPivot = sizeof(T) == 4;
  struct Row {
    int64_t load_end;
    float pivot;
  };
  __device__ __forceinline__ Row row(int64_t, const T* x_row) const {
    return {this->n, kPivot ? to_float(x_row[0]) : 0.f};
  }

  template <int VEC>
  __device__ __forceinline__ void prepare(float (&)[VEC], const NoAux&, const Row&, int) const {}

  using State = LayerNormState<T>;

  template <int NV, int VEC, class Valid>
  __device__ __forceinline__ State local(float (&z)[NV][VEC], const Row& rc, Valid valid) const {
    const float shift = kPivot ? rc.pivot : 0.f;
    float sum = 0.f, cnt = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (valid(k, j)) {
          sum += z[k][j] - shift;
          cnt += 1.f;
        }
    if (cnt == 0.f) return State::identity();
    // The quotient refined by one Newton step on its exact (FMA) residual, so that a chunk of
    // equal values has exactly their value as its mean and m2 = 0: a 16-bit row of equal
    // values (no pivot) otherwise got a variance of a few ulps of the mean and outputs off by
    // that times rstd. IEEE division (__fdiv_rn) spilled.
    const float inv = __fdividef(1.f, cnt);
    float mean = sum * inv;
    mean = fmaf(fmaf(-mean, cnt, sum), inv, mean);
    // The deviations from the chunk's mean in z's terms: that mean is rounded at the pivot's
    // magnitude, an error m2 feels only squared; center + center_err = shift + mean exactly.
    float center_err = 0.f;
    const float center = kPivot ? two_sum(shift, mean, center_err) : shift + mean;
    float m2 = 0.f, dsum = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (valid(k, j)) {
          const float d = z[k][j] - center;
          if constexpr (kPivot) dsum += d;
          m2 = fmaf(d, d, m2);
        }
    if constexpr (!kPivot) {
      return {cnt, mean, m2};
    } else {
      // With a pivot the sum above rounded at |x - pivot|, which is the row's spread (or more)
      // where the pivot is an outlier (several times PyTorch's error). The deviations' sum is
      // that rounding error times cnt; the corrected two-pass statistics take it out. The
      // chunk's sum of x - pivot is then, exactly up to dsum's own
      // rounding (at the deviations' size), cnt * (mean - center_err) + dsum, the product's
      // error from an FMA.
      const float hi = __fmul_rn(cnt, mean);
      const float product_err = fmaf(cnt, mean, -hi);
      const float lo = __fadd_rn(__fsub_rn(product_err, __fmul_rn(cnt, center_err)), dsum);
      return {cnt, hi, lo, m2 - dsum * (dsum * inv)};
    }
  }

  // The mean that output() subtracts from z = x: without a pivot the mean itself (lo 0), else
  // pivot + mean as an unevaluated sum hi + lo (TwoSum: exact), so that z - hi - lo rounds
  // about once, as x - mean does.
  struct Fin {
    float mean_hi, mean_lo, rstd;
  };
  using Out = Fin;

  __device__ __forceinline__ Fin finish(const State& t, const Row& rc) const {
    const float rstd = this->rstd_of(t.m2);  // biased, as F.layer_norm
    if constexpr (!kPivot) {
      return {t.mean, 0.f, rstd};
    } else {
      // mean = (hi + lo) / n as mean + mean_lo, the quotient's remainder exact by FMA; then
      // pivot + mean as hi + lo by TwoSum.
      const float n = static_cast<float>(this->n);
      const float mean = t.hi / n;
      const float mean_lo = __fadd_rn(fmaf(-mean, n, t.hi), t.lo) / n;
      float err;
      const float hi = two_sum(rc.pivot, mean, err);
      return {hi, __fadd_rn(err, mean_lo), rstd};
    }
  }

  template <int VEC>
  __device__ __forceinline__ void output(float (&v)[VEC], const Out& o,
                                         const ParamValues<2, VEC>& p) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = kPivot ? (v[j] - o.mean_hi) - o.mean_lo : v[j] - o.mean_hi;
      v[j] = fmaf(d * o.rstd, p.v[0][j], p.v[1][j]);
    }
  }
};

template <typename T>
struct RmsNormOp : NormOpBase<T, Sum, 1> {  // the sum of squares
  static constexpr const Tunable& kCtaRowValues = kRmsNormCtaRowValues;
  static constexpr const Tunable& kRowsPerCta = kRmsNormRowsPerCta;
  struct Row {
    int64_t load_end;
  };
  __device__ __forceinline__ Row row(int64_t, const T*) const { return {this->n}; }

  template <int VEC>
  __device__ __forceinline__ void prepare(float (&)[VEC], const NoAux&, const Row&, int) const {}

  // Unread columns are 0 and add nothing, so `valid` is not needed.
  template <int NV, int VEC, class Valid>
  __device__ __forceinline__ Sum local(float (&z)[NV][VEC], const Row&, Valid) const {
    return {
        fold<NV * VEC>([&](int i) { return z[i / VEC][i % VEC] * z[i / VEC][i % VEC]; }, Add{})};
  }

  struct Fin {
    float rstd;
  };
  using Out = Fin;

  __device__ __forceinline__ Fin finish(const Sum& t, const Row&) const {
    return {this->rstd_of(t.v)};
  }

  // fp32 on sm_90+: x * rstd * weight rounded once (x * rstd's rounding error, taken exactly
  // by an FMA, is carried into the product with the weight), where two products round twice.
  // The backward recovers x_hat as y / weight, so y's rounding reaches the gradients (two
  // roundings failed test_backward's bound on an 8-wide fp32 row). Builds for sm_75-sm_89
  // keep the two roundings: there the kernel that holds 64 values per thread and caches the
  // weight spilled with the FMA's operands. 16-bit outputs
  // round far coarser than either.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr bool kOneRounding = sizeof(T) == 4;
#else
  static constexpr bool kOneRounding = false;
#endif
  template <int VEC>
  __device__ __forceinline__ void output(float (&v)[VEC], const Out& o,
                                         const ParamValues<1, VEC>& p) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kOneRounding) {
        const float xr = v[j] * o.rstd;
        const float err = fmaf(v[j], o.rstd, -xr);
        v[j] = fmaf(xr, p.v[0][j], err * p.v[0][j]);
      } else {
        v[j] = v[j] * o.rstd * p.v[0][j];
      }
    }
  }
};

// Vector accesses need x's rows and the per-column parameters 16-byte aligned.
template <typename T>
bool norm_aligned(const T* x, const RowLayout& layout, const T* weight, const T* bias) {
  return layout.col_stride == 1 && rows_aligned(x, layout.row, sizeof(T), 16) &&
         ptr_aligned(weight, 16) && ptr_aligned(bias, 16);
}

}  // namespace

template <typename T>
cudaError_t launch_layer_norm(T* x, const RowLayout& layout, const T* weight, const T* bias,
                              float eps, float* rstd_out, cudaStream_t stream) {
  LayerNormOp<T> op;
  op.params = {{weight, bias}, {1.f, 0.f}};
  op.rstd_out = rstd_out;
  op.eps = eps;
  op.n = layout.n;
  return launch_rows(x, layout, op, norm_aligned(x, layout, weight, bias), stream);
}

template <typename T>
cudaError_t launch_rms_norm(T* x, const RowLayout& layout, const T* weight, float eps,
                            float* rstd_out, cudaStream_t stream) {
  RmsNormOp<T> op;
  op.params = {{weight}, {1.f}};
  op.rstd_out = rstd_out;
  op.eps = eps;
  op.n = layout.n;
  return launch_rows(x, layout, op, norm_aligned<T>(x, layout, weight, nullptr), stream);
}

#define MTI_INSTANTIATE_NORMS(T)                                                             \
  template cudaError_t launch_layer_norm<T>(T*, const RowLayout&, const T*, const T*, float, \
                                            float*, cudaStream_t);                           \
  template cudaError_t launch_rms_norm<T>(T*, const RowLayout&, const T*, float, float*,     \
                                          cudaStream_t);

}  // namespace mti
