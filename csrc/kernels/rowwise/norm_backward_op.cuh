// The norms' backward op (LayerNorm, RMSNorm) for the backward kernel (backward_kernel.cuh),
// shared by its launcher (norm_backward.cu) and the parameter gradient sums (param_sums.cu).
#pragma once

#include "kernels/rowwise/framework.cuh"

namespace mti {

template <typename T>
struct NormBackwardOp {
  // fp32 sums: in fp64 the fp32 resident kernel, which holds y, dy and two column sums per
  // element in registers, spills.
  using State = Sum2<float>;  // sum(g_hat), sum(g_hat * x_hat) = sum(grad * t)
  static constexpr bool kHasParams = true;
  static constexpr bool kReadsOnlyRows = false;  // reads rstd, weight and bias too
  static constexpr int kResidentElems = kParamElems;
  // Rows past a CTA's registers take RowPath::kShared: held by a cluster's registers instead
  // (as softmax's are), fp32 rows ran slower (fp32 caches no columns on that path, see
  // kCacheColumns, and that kernel then spilled) and 16-bit ones no faster.
  static constexpr bool kClusterRegisters = false;
  // Per column, as floats: the weight and the bias (1 and 0 where absent) and for 16-bit
  // types the weight's approximate reciprocal (0 where the weight is 0; fp32 divides, see
  // grad()); see columns(). Cached (see backward_kernel's kCache) for 16-bit types, and for
  // fp32 on the shared path only: its register kernel with parameter gradients has no
  // register to spare (with the cache it spilled on sm_90); on the shared path, where its
  // weight and bias loads hit L1 only half the time, fp32 gained most.
  static constexpr int kColumnValues = sizeof(T) == 4 ? 2 : 3;
  template <RowPath kPath>
  static constexpr bool kCacheColumns = sizeof(T) == 2 || kPath == RowPath::kShared;
  // Rows per step on the shared path's largest clusters (see backward_kernel's kR and
  // kGroupedRowsPastCluster), where that costs no occupancy: they share one pass of each
  // reduction, the cluster's included, whose cost grows with the cluster.
  static constexpr int kSharedRows = norm_shared_rows(sizeof(T));
  // See kLargeCtaThreads; the norms have no register clusters.
  static constexpr bool kLargeCtas = norm_large_ctas(sizeof(T));
  enum { kW, kB, kRw };

  const T* weight;  // nullptr or n contiguous elements
  const T* bias;
  const float* rstd;
  float inv_n;  // 1 / the row's length: a row's means cost a multiply, not a division
  bool rms;

  // The row's saved rstd, read before the row is reduced (see backward_kernel), so that its
  // latency hides behind the reduction instead of stalling the write after it.
  struct Row {
    float rstd;
  };
  struct Fin {
    float rstd, mean_g, mean_gx;
  };

  __device__ __forceinline__ Row row(int64_t r) const { return {rstd[r]}; }

  // The column values of the vector at c0, from global memory. The resident paths compute
  // them once per kernel into shared memory (a thread owns the same columns in every row)
  // and read them from there: in every row's two passes the weight and bias loads, their
  // widening and a reciprocal per element made a third of the instructions of the 16-bit
  // kernels, which issue-bound them.
  template <int VEC>
  __device__ __forceinline__ ParamValues<kColumnValues, VEC> columns(int64_t c0) const {
    ParamValues<kColumnValues, VEC> p;
    if (weight) to_floats(p.v[kW], load_vec<VEC>(weight, c0, 1));
    if (bias) to_floats(p.v[kB], load_vec<VEC>(bias, c0, 1));
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (!weight) p.v[kW][j] = 1.f;
      if (!bias) p.v[kB][j] = 0.f;
      if constexpr (kColumnValues > kRw)
        p.v[kRw][j] = p.v[kW][j] == 0.f ? 0.f : rcp_ftz(p.v[kW][j]);
    }
    return p;
  }

  // t = y - bias = x_hat * weight and g_hat = grad * weight. Everything but grad_x's x_hat
  // term is written with t, so that no element needs a division: sum(g_hat * x_hat) is
  // sum(grad * t), and grad_weight's column sums of grad * x_hat are sum(grad * t) / weight,
  // one division per column (sum_partials_kernel).
  template <int VEC>
  __device__ __forceinline__ void terms(float (&t)[VEC], float (&gh)[VEC], const float (&y)[VEC],
                                        const float (&g)[VEC],
                                        const ParamValues<kColumnValues, VEC>& p) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      t[j] = y[j] - p.v[kB][j];
      gh[j] = g[j] * p.v[kW][j];
    }
  }

  template <int VEC>
  __device__ __forceinline__ void add(State& s, const float (&y)[VEC], const float (&g)[VEC],
                                      const ParamValues<kColumnValues, VEC>& p) const {
    float t[VEC], gh[VEC];
    terms(t, gh, y, g, p);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      s.a += gh[j];
      s.b += g[j] * t[j];
    }
  }

  __device__ __forceinline__ Fin finish(const State& total, const Row& rc) const {
    return {rc.rstd, rms ? 0.f : total.a * inv_n, total.b * inv_n};
  }

  // grad_x of one vector into out and, with kParams, grad * t and grad added to acc_w and
  // acc_b (see terms()). x_hat = t / weight, 0 where weight is 0 (y tells nothing of x
  // there). 16-bit types move twice the elements per byte and are bound by instructions per
  // element, so they take the cheap forms: x_hat as t times the reciprocal, and grad_x as two
  // FMAs on the row's means times rstd. fp32 keeps the division and the textbook form: the
  // fused one makes its register kernel spill.
  template <bool kParams, int VEC>
  __device__ __forceinline__ void grad(float (&out)[VEC], float (&acc_w)[VEC], float (&acc_b)[VEC],
                                       const float (&y)[VEC], const float (&g)[VEC],
                                       const ParamValues<kColumnValues, VEC>& p, int64_t,
                                       const Row&, const Fin& f) const {
    float t[VEC], gh[VEC];
    terms(t, gh, y, g, p);
    const float rstd_mean_g = f.rstd * f.mean_g, rstd_mean_gx = f.rstd * f.mean_gx;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (sizeof(T) == 4) {
        const float w = p.v[kW][j], xh = w == 0.f ? 0.f : t[j] / w;
        out[j] = f.rstd * (gh[j] - f.mean_g - xh * f.mean_gx);
      } else {
        out[j] = fmaf(-t[j] * p.v[kColumnValues - 1][j], rstd_mean_gx,
                      fmaf(gh[j], f.rstd, -rstd_mean_g));
      }
      if constexpr (kParams) {
        acc_w[j] += g[j] * t[j];
        acc_b[j] += g[j];
      }
    }
  }
};

}  // namespace mti
