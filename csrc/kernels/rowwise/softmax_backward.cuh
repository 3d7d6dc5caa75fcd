// softmax / log_softmax backward from the forward's output y: the op functor for the backward
// kernel (backward_kernel.cuh), and its launcher.
// Instantiated once per dtype, in softmax_backward_{f32,f16,bf16}.cu, which the build compiles in
// parallel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/rowwise/backward.cuh"
#include "kernels/rowwise/rowwise.h"
#include "kernels/rowwise/softmax_rows.cuh"

namespace mti {
namespace {

// What softmax's backward sums its rows in. fp32 rows sum in fp64: in fp32, the rounding of
// a sum near a peaked row's largest term reaches grad_x undiminished wherever grad and the
// sum's mean cancel, up to several times PyTorch's error. Products of two fp32 values are
// exact in fp64. 16-bit rows keep fp32, far finer than their outputs.
template <typename T>
using AccOf = std::conditional_t<std::is_same_v<T, float>, double, float>;

// v as a float and the rounding error of that, so that x - v is computed as (x - hi) - lo,
// nearly as accurately as in v's precision. kLo: whether lo can be nonzero (not for a float
// v, whose users then skip it).
template <typename A>
struct Split {
  static constexpr bool kLo = !std::is_same_v<A, float>;
  float hi, lo;
  Split() = default;
  __device__ __forceinline__ explicit Split(A v)
      : hi(static_cast<float>(v)), lo(static_cast<float>(v - static_cast<A>(hi))) {}
};

template <typename T, MaskKind kMask>
struct SoftmaxBackwardOp : SoftmaxRows<kMask> {
  using Rows = SoftmaxRows<kMask>;
  using Rows::log;
  using Rows::mask_col_stride;
  using Rows::scale;
  using Acc = AccOf<T>;
  using State = Sum2<Acc>;  // sum(grad * y) and sum(y); log_softmax: sum(grad), sum(exp(y))
  using MaskT = typename Rows::template MaskOf<T>;
  static constexpr bool kHasParams = false;
  static constexpr bool kReadsOnlyRows = kMask == MaskKind::kNone;
  static constexpr int kResidentElems = kSoftmaxElems;
  // Rows past a CTA's registers may be held by a cluster's registers (RowPath::kCluster; see
  // softmax_cluster_registers), and rows that a CTA (cluster) holds only with more elements
  // per thread take the wide paths (softmax_wide_elems).
  static constexpr bool kClusterRegisters = true;
  static constexpr int kWideElems = softmax_wide_elems(sizeof(T));
  static constexpr int kColumnValues = 0;
  template <RowPath>
  static constexpr bool kCacheColumns = false;
  static constexpr int kSharedRows = 1;
  static constexpr bool kLargeCtas = true;  // see kLargeCtaThreads

  struct Row {
    int64_t limit;  // columns from `limit` on are causally masked
    const MaskT* mask;
  };
  struct Fin {
    Split<Acc> s;  // sum(grad * y) / sum(y), or sum(grad) / sum(exp(y)) for log_softmax
  };

  __device__ __forceinline__ Row row(int64_t r) const {
    return {this->causal_limit(r), this->template mask_row<T>(r)};
  }

  template <int VEC>
  __device__ __forceinline__ ParamValues<0, VEC> columns(int64_t) const {
    return {};
  }

  // Where with_exp has two ways (16-bit, no mask tensor), add() and grad() keep softmax's loop
  // apart from log_softmax's: one loop for both inside with_exp slowed softmax_ down.
  // Elsewhere one loop serves both: apart, fp16's masked kernels of rows that no cluster
  // holds (RowPath::kWideCluster) spilled on sm_90a.
  static constexpr bool kLoopsApart = sizeof(T) == 2 && kMask == MaskKind::kNone;

  // Calls f with log_softmax's exp for a vector y: with_exp_for, from the vector's smallest y
  // (as the forward's SoftmaxOp::local does per chunk). Not with a mask tensor: skipping its
  // -inf costs an FMA per element, and the fp16 kernels of rows that no cluster holds
  // otherwise spilled. f is called once, so that each exp is computed where it is
  // used.
  template <int VEC, class F>
  __device__ __forceinline__ void with_exp(const float (&y)[VEC], F f) const {
    static_assert(kLoopsApart, "with_exp serves the loops apart only");
    with_exp_for<T>(no_subnormal_exps(fold<VEC>([&](int j) { return y[j]; }, Min{})), f);
  }

  template <int VEC>
  __device__ __forceinline__ void add(State& s, const float (&y)[VEC], const float (&g)[VEC],
                                      const ParamValues<0, VEC>&) const {
    if constexpr (kLoopsApart) {
      if (log) {
        with_exp(y, [&](auto exp) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            s.a += Acc(g[j]);
            s.b += Acc(exp(y[j]));
          }
        });
        return;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const Acc gj = g[j], yj = y[j];
        s.a += gj * yj;
        s.b += yj;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const Acc gj = g[j], yj = y[j];
        s.a += log ? gj : gj * yj;
        s.b += log ? Acc(exp_for<T>(y[j])) : yj;
      }
    }
  }

  // The division is by 1 but for rounding: the rounded probabilities of a stored output need
  // not sum to 1 (a 16-bit y, or a log-probability's shared offset), and where grad and s
  // cancel, that error would dominate grad_x. 0 for a row with no active element.
  __device__ __forceinline__ Fin finish(const State& total, const Row&) const {
    return {Split<Acc>(total.b > Acc(0) ? total.a / total.b : Acc(0))};
  }

  // grad_x of one vector into out (no parameter gradients: acc_w, acc_b untouched).
  template <bool kParams, int VEC>
  __device__ __forceinline__ void grad(float (&out)[VEC], float (&)[VEC], float (&)[VEC],
                                       const float (&y)[VEC], const float (&g)[VEC],
                                       const ParamValues<0, VEC>&, int64_t c0, const Row& rc,
                                       const Fin& f) const {
    Packed<MaskT, VEC> m;
    if constexpr (kMask != MaskKind::kNone)  // a bool one kept in L2, as in the forward
      m = load_vec<VEC, kMask == MaskKind::kBool>(rc.mask, c0, mask_col_stride);
    const auto active_at = [&](int j) {
      bool active = c0 + j < rc.limit;
      if constexpr (kMask == MaskKind::kBool) active = active && m.v[j] != 0;
      if constexpr (kMask == MaskKind::kAdditive) active = active && to_float(m.v[j]) != -INFINITY;
      return active;
    };
    if constexpr (kLoopsApart) {
      const auto each = [&](auto dz_of) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] = active_at(j) ? dz_of(j) * scale : 0.f;
      };
      if (log) {
        with_exp(y, [&](auto exp) {
          each([&](int j) {
            const float e = exp(y[j]);
            const float dz = fmaf(-e, f.s.hi, g[j]);
            return Split<Acc>::kLo ? fmaf(-e, f.s.lo, dz) : dz;
          });
        });
      } else {
        each([&](int j) {
          const float dz = Split<Acc>::kLo ? (g[j] - f.s.hi) - f.s.lo : g[j] - f.s.hi;
          return dz * y[j];
        });
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const bool active = active_at(j);
        float dz;
        if (log) {
          const float e = exp_for<T>(y[j]);
          dz = fmaf(-e, f.s.hi, g[j]);
          if constexpr (Split<Acc>::kLo) dz = fmaf(-e, f.s.lo, dz);
        } else {
          dz = g[j] - f.s.hi;
          if constexpr (Split<Acc>::kLo) dz -= f.s.lo;
          dz *= y[j];
        }
        out[j] = active ? dz * scale : 0.f;
      }
    }
  }
};

// softmax's launch choices for this call (rowwise/tuning.h): `masked`, whether a mask tensor
// is read (log_softmax's only, see launch_softmax_backward).
OpChoices softmax_choices(const TuningKey& key, bool log, bool masked) {
  const Tunable& cluster_registers = !log     ? kSoftmaxClusterRegisters
                                     : masked ? kMaskedLogSoftmaxClusterRegisters
                                              : kLogSoftmaxClusterRegisters;
  OpChoices c;
  c.cluster_registers = static_cast<ClusterRegisters>(tuned(cluster_registers, key));
  c.row_per_cta = tuned(kSoftmaxRowPerCta, key) != 0;
  c.large_cluster_min = tuned(kLargeClusterMin, key);
  return c;
}

template <typename T, MaskKind kMask>
cudaError_t launch_softmax_masked(const T* y, const T* dy, T* dx, const BackwardRows& L,
                                  const void* mask, const MaskLayout& ML,
                                  const SoftmaxParams& params, cudaStream_t stream) {
  using Op = SoftmaxBackwardOp<T, kMask>;
  const Op op{{mask, ML, params, L.y.n}};
  int device = 0;
  DeviceInfo dev;
  const cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  const bool aligned =
      all_rows_aligned(y, dy, dx, L, sizeof(T)) && op.template mask_vectors_aligned<T>();
  const OpChoices choices =
      softmax_choices(tuning_key(dev, sizeof(T), L.y.n), params.log, kMask != MaskKind::kNone);
  const Launch l = plan_launch<Op, T>(L, aligned, 0, device, dev, choices);
  return launch_paths(y, dy, dx, L, op, l, Partials{nullptr, nullptr}, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_softmax_backward(const T* y, const T* grad, T* grad_x, const BackwardRows& rows,
                                    const void* mask, const MaskLayout& mask_layout,
                                    const SoftmaxParams& params, cudaStream_t stream) {
  if (rows.y.rows == 0 || rows.y.n == 0) return cudaSuccess;
  // softmax's y (unlike log_softmax's) is exactly 0 wherever the mask drops an element, so
  // (grad - s) * y gives grad_x's 0 there without reading the mask, whose loads cost up to
  // 1.4x the time of the unmasked kernel. That holds for a finite grad; a non-finite one at a
  // dropped element makes s, hence the whole row's grad_x, NaN either way (s sums grad * y
  // over every element).
  switch (params.log ? mask_layout.kind : MaskKind::kNone) {
    case MaskKind::kBool:
      return launch_softmax_masked<T, MaskKind::kBool>(y, grad, grad_x, rows, mask, mask_layout,
                                                       params, stream);
    case MaskKind::kAdditive:
      return launch_softmax_masked<T, MaskKind::kAdditive>(y, grad, grad_x, rows, mask, mask_layout,
                                                           params, stream);
    case MaskKind::kNone:
      break;
  }
  return launch_softmax_masked<T, MaskKind::kNone>(y, grad, grad_x, rows, mask, mask_layout, params,
                                                   stream);
}

#define MTI_INSTANTIATE_SOFTMAX_BACKWARD(T)                                                    \
  template cudaError_t launch_softmax_backward<T>(const T*, const T*, T*, const BackwardRows&, \
                                                  const void*, const MaskLayout&,              \
                                                  const SoftmaxParams&, cudaStream_t);

}  // namespace mti
