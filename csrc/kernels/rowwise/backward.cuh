// The launch of the backward kernel (backward_kernel.cuh): the path and thread shape for a
// row length, the grid, and the launch itself. The ops' launchers (softmax_backward.cu,
// norm_backward.cu) call plan_launch() and launch_paths().
#pragma once

#include <algorithm>
#include <limits>
#include <type_traits>

#include "kernels/rowwise/backward_kernel.cuh"

namespace mti {

// Bytes of scratch for the parameter gradients' partial rows that a launch may always take;
// past them, at most a quarter of grad_x's bytes (the grid is capped accordingly).
constexpr int64_t kScratchFloor = int64_t{4} << 20;

// The launch choices an op makes per call, from its tables (tuning.h); the norms take the
// defaults.
struct OpChoices {
  ClusterRegisters cluster_registers = ClusterRegisters::kNone;
  // Whether vector register rows of more than a warp take a CTA each rather than sharing CTAs
  // of up to kMaxThreads.
  bool row_per_cta = false;
  // Register clusters take large CTAs where those of kMaxThreads would number this many.
  int64_t large_cluster_min = 0;
};

// The path, threads per row group and CTA, and CTAs per row, for rows of `vecs` vectors:
// registers (reg_nv vectors per thread) where a CTA's hold the row, or wide_nv (0: the op
// has no wide paths) where only those do; else (as cluster_registers says) the registers of
// as few CTAs as hold it with reg_nv each, or wide_nv where reg_nv needs more than
// max_cluster, or (otherwise) their shared memory (shared_nv per thread), up to
// `max_cluster` CTAs (0: none), else streamed. large_threads > 0 (vector rows) is the size of
// the larger CTAs some rows take: with large_registers (Op::kLargeCtas), rows that one such
// CTA holds in registers (wide_nv where the op has it) take one before any cluster, and
// register clusters take such CTAs where those of kMaxThreads would number at least
// large_cluster_min and hold the row without the wide path; shared-path rows take them where
// more CTAs of kMaxThreads than max_cluster (> 1) would be needed.
struct Shape {
  int threads = 0;  // CTA size
  int tpr = 0;      // threads per row (a divisor of threads; on a cluster, the CTA's share)
  int cluster = 1;  // CTAs per row: > 1 only on sm_90+
  RowPath path = RowPath::kRegisters;
};

inline Shape pick_shape(int64_t vecs, int reg_nv, int wide_nv, int shared_nv, int max_cluster,
                        bool row_per_cta, ClusterRegisters cluster_registers, int large_threads,
                        bool large_registers, int64_t large_cluster_min) {
  Shape s;
  if (vecs <= int64_t{kWarpSize} * reg_nv) {
    // The fewest lanes that hold the row: more bytes in flight per thread, fewer shuffles.
    s.tpr = static_cast<int>(next_pow2(ceil_div(vecs, reg_nv)));
    s.threads = kSmallRowThreads;
    return s;
  }
  if (vecs <= int64_t{kMaxThreads} * reg_nv) {
    // As many rows per CTA as fit in kMaxThreads (but `row_per_cta`): with parameter
    // gradients each CTA writes one scratch row, so fewer, larger CTAs mean fewer partial
    // sums to write and add.
    s.tpr = static_cast<int>(round_up(ceil_div(vecs, reg_nv), kWarpSize));
    s.threads = row_per_cta ? s.tpr : s.tpr * (kMaxThreads / s.tpr);
    return s;
  }
  // As few full CTAs as hold the row (any count: a power of two would leave up to half of
  // them idle), or streamed.
  s.threads = s.tpr = kMaxThreads;
  const bool wide = wide_nv > 0 && max_cluster > 0;
  if (wide && vecs <= int64_t{kMaxThreads} * wide_nv) {
    s.path = RowPath::kWideRegisters;
    return s;
  }
  if (large_registers && large_threads > 0) {
    const int nv = wide ? wide_nv : reg_nv;
    if (vecs <= int64_t{large_threads} * nv) {
      s.threads = s.tpr = static_cast<int>(round_up(ceil_div(vecs, nv), kWarpSize));
      s.path = wide ? RowPath::kWideRegisters : RowPath::kRegisters;
      return s;
    }
  }
  int64_t ctas = ceil_div(vecs, int64_t{kMaxThreads} * reg_nv);
  const bool large_cluster = large_registers && large_threads > 0 && ctas >= large_cluster_min &&
                             (ctas <= max_cluster || !wide);
  if (cluster_registers == ClusterRegisters::kAll ||
      (cluster_registers == ClusterRegisters::kLargeCtas && large_cluster)) {
    s.path = RowPath::kCluster;
    if (large_cluster) {
      ctas = ceil_div(vecs, int64_t{large_threads} * reg_nv);
      s.threads = s.tpr = large_threads;
    } else if (wide && ctas > max_cluster) {
      ctas = ceil_div(vecs, int64_t{s.threads} * wide_nv);
      s.path = RowPath::kWideCluster;
    }
  } else {
    ctas = ceil_div(vecs, int64_t{kMaxThreads} * shared_nv);
    s.path = RowPath::kShared;
    // Only where clusters run: there such rows take clusters of 9-16 large CTAs, as measured
    // and tested. Without clusters some would take one large CTA on this path, a case never
    // run.
    if (large_threads > 0 && max_cluster > 1 && ctas > max_cluster) {
      ctas = ceil_div(vecs, int64_t{large_threads} * shared_nv);
      s.threads = s.tpr = large_threads;
    }
  }
  if (ctas <= max_cluster) {
    s.cluster = static_cast<int>(ctas);
  } else {
    s.threads = s.tpr = kMaxThreads;
    s.path = RowPath::kStream;
  }
  return s;
}

constexpr Shape kStreamShape{kMaxThreads, kMaxThreads, 1, RowPath::kStream};

// Calls f with the CTA size (a std::integral_constant) that backward_kernel is compiled for
// on kPath with VEC for a launch of `threads` threads: kLargeCtaThreads past kMaxThreads (on
// the shared vector path and the register vector paths of ops with Op::kLargeCtas, the only
// ones compiled so); else kMaxThreads, for launches of up to as many.
template <class Op, RowPath kPath, int VEC, class F>
decltype(auto) with_cta(int threads, F f) {
  if constexpr (VEC > 1 &&
                (kPath == RowPath::kShared || (Op::kLargeCtas && kPath != RowPath::kStream)))
    if (threads > kMaxThreads) return f(std::integral_constant<int, kLargeCtaThreads>{});
  return f(std::integral_constant<int, kMaxThreads>{});
}

// resident_units() of the resident backward_kernel (VEC, kPath, kParams, kCache, kR, kCta): 0
// if none fits (the staged rows and cached columns exceed the shared memory a CTA may have).
template <class Op, typename T, int VEC, RowPath kPath, bool kParams, bool kCache, int kR = 1,
          int kCta = kMaxThreads>
int64_t resident_backward_units(int device, int threads, int cluster, int sm_count) {
  constexpr int NV = path_nv<Op>(kPath, VEC, kParams);
  const int64_t smem = resident_backward_smem<Op>(kPath, VEC, NV, threads, kParams,
                                                  kCache ? Op::kColumnValues : 0, kR);
  return resident_units<backward_kernel<Op, T, VEC, NV, kPath, kParams, kCache, kR, kCta>, kCta>(
      device, threads, cluster, static_cast<size_t>(smem), sm_count);
}

using One = std::integral_constant<int, 1>;

// How a backward pass is launched: the vector width, the thread shape and the grid.
struct Launch {
  bool vec = false;
  bool cache = false;   // resident vector rows with the column cache (see ColumnCache)
  int shared_rows = 1;  // rows per row group and step on the shared path (kR)
  Shape shape;
  int64_t grid = 0;             // CTAs
  int64_t partial_rows = 0;     // P: scratch rows per wanted parameter gradient
  int64_t smem_sums_bytes = 0;  // streaming path's parameter gradient sums in shared memory
  int64_t column_tiles = 0;     // > 0: the sums by column_sums_kernel, P row slices of tiles
};

// How many times over plan_launch's grid holds the resident CTAs (clusters) of `shape`; 0: a
// CTA per row group, none striding. A larger grid lets the hardware start the next CTA as one
// finishes, which evens out the end, but each CTA pays its setup (the column cache, its
// scratch row of the parameter gradients) once. A CTA per row group for softmax's register
// rows, and its wide rows on CTAs of kMaxThreads where cluster registers are cheap: the next
// row's prefetch then has nothing to hide that the hardware's next CTA does not;
// kWideWaves for its other wide rows. kSharedWaves for shared-path clusters of up to
// kSharedWavesMaxCluster that neither sum parameter gradients nor cache columns (16-bit
// log_softmax). One grid for the others.
template <class Op>
int64_t grid_waves(const Shape& shape, bool params, bool cache, ClusterRegisters cluster_registers,
                   const TuningKey& key) {
  if (always_cta_per_group<Op>(shape.path)) return 0;
  if (!Op::kHasParams && shape.path == RowPath::kWideRegisters) {
    const bool per_group =
        cluster_registers == ClusterRegisters::kAll ||
        (cluster_registers == ClusterRegisters::kLargeCtas && shape.threads == kMaxThreads);
    return per_group ? 0 : tuned(kWideWaves, key);
  }
  return shape.path == RowPath::kShared && !params && !cache &&
                 shape.cluster <= tuned(kSharedWavesMaxCluster, key)
             ? tuned(kSharedWaves, key)
             : 1;
}

// `aligned`: every row (and side input) is 16-byte aligned with col_stride 1. Resident rows
// run on as many CTAs (clusters) as fit on the GPU at once (grid_waves() times that), each
// striding over rows (which its staging needs), or where grid_waves() says so on a CTA per
// row group; vector rows that fit on no SM (or in no cluster that fits) are streamed. With
// parameter gradients, the grid is capped so that the scratch stays within its bound.
template <class Op, typename T>
Launch plan_launch(const BackwardRows& L, bool aligned, int param_arrays, int device,
                   const DeviceInfo& dev, const OpChoices& choices = OpChoices{}) {
  const int sm_count = dev.sm_count;
  Launch l;
  const int64_t n = L.y.n;
  const TuningKey key = tuning_key(dev, sizeof(T), n);
  l.vec = aligned && n % kVec<T> == 0;
  const int vec = l.vec ? kVec<T> : 1;
  const bool params = param_arrays > 0;
  const int wide_nv =
      has_wide_registers<Op>() ? path_nv<Op>(RowPath::kWideRegisters, vec, params) : 0;
  const auto shape = [&](bool large) {
    return pick_shape(ceil_div(n, vec), path_nv<Op>(RowPath::kRegisters, vec, params), wide_nv,
                      path_nv<Op>(RowPath::kShared, vec, params),
                      !l.vec ? 0 : max_cluster(dev, key), l.vec && choices.row_per_cta,
                      choices.cluster_registers, large ? kLargeCtaThreads : 0, Op::kLargeCtas,
                      choices.large_cluster_min);
  };
  // Vector rows only: scalar rows keep kScalarNV elements per thread on CTAs of kMaxThreads.
  l.shape = shape(l.vec);
  // Row groups (CTAs or clusters) the grid may hold: from the resident ones (below), else
  // (streamed rows) as many CTAs as the SMs' threads allow.
  int64_t max_units = 0;
  if (l.shape.path != RowPath::kStream) {
    const auto resident = [&](auto params_const, auto cache_const, auto rows_const) -> int64_t {
      constexpr bool kParams = decltype(params_const)::value;
      constexpr bool kCache = decltype(cache_const)::value;
      constexpr int kR = decltype(rows_const)::value;
      const int threads = l.shape.threads, cluster = l.shape.cluster;
      if (!l.vec) {
        if constexpr (kCache) return 0;  // the scalar path reads its columns from global memory
        return resident_backward_units<Op, T, 1, RowPath::kRegisters, kParams, false>(
            device, threads, cluster, sm_count);
      }
      // 0 where the op caches no columns on the path.
      const auto on = [&](auto path_const) -> int64_t {
        constexpr RowPath kPath = decltype(path_const)::value;
        if constexpr ((kCache && !Op::template kCacheColumns<kPath>) ||
                      (kR > 1 && kPath != RowPath::kShared)) {
          return 0;
        } else {
          return with_cta<Op, kPath, kVec<T>>(threads, [&](auto cta) {
            return resident_backward_units<Op, T, kVec<T>, kPath, kParams, kCache, kR,
                                           decltype(cta)::value>(device, threads, cluster,
                                                                 sm_count);
          });
        }
      };
      if constexpr (has_wide_registers<Op>()) {
        if (l.shape.path == RowPath::kWideRegisters) return on(PathTag<RowPath::kWideRegisters>{});
        if (l.shape.path == RowPath::kWideCluster) return on(PathTag<RowPath::kWideCluster>{});
      }
      if constexpr (Op::kClusterRegisters)
        if (l.shape.path == RowPath::kCluster) return on(PathTag<RowPath::kCluster>{});
      return l.shape.path == RowPath::kShared ? on(PathTag<RowPath::kShared>{})
                                              : on(PathTag<RowPath::kRegisters>{});
    };
    // The cache, and then rows taken Op::kSharedRows at a time, where they cost no
    // occupancy (their shared memory may leave fewer CTAs per SM).
    const auto fitting = [&](auto params_const) {
      const int64_t plain = resident(params_const, std::false_type{}, One{});
      const int64_t cached = resident(params_const, std::true_type{}, One{});
      l.cache = cached > 0 && cached >= plain;
      const int64_t units = l.cache ? cached : plain;
      if constexpr (Op::kSharedRows > 1) {
        if (l.cache && l.shape.path == RowPath::kShared &&
            l.shape.cluster > tuned(kGroupedRowsPastCluster, key)) {
          const int64_t grouped = resident(params_const, std::true_type{},
                                           std::integral_constant<int, Op::kSharedRows>{});
          l.shared_rows = grouped >= units ? Op::kSharedRows : 1;
          if (l.shared_rows > 1) return grouped;
        }
      }
      return units;
    };
    const auto fits_of = [&] {
      if constexpr (Op::kHasParams)
        return params ? fitting(std::true_type{}) : fitting(std::false_type{});
      else
        return fitting(std::false_type{});
    };
    int64_t fits = fits_of();
    if (fits == 0 && l.shape.threads > kMaxThreads) {
      // A large CTA that no SM holds (its staging buffers past the shared memory).
      l.shape = shape(false);
      if (l.shape.path != RowPath::kStream) fits = fits_of();
    }
    if (fits > 0) {
      const int64_t waves =
          grid_waves<Op>(l.shape, params, l.cache, choices.cluster_registers, key);
      max_units = waves > 0 ? fits * waves : std::numeric_limits<int>::max() / l.shape.cluster;
    } else if (l.vec) {
      l.shape = kStreamShape;
    }
  }
  if (max_units == 0) max_units = int64_t{sm_count} * (tuned(kThreadsPerSm, key) / l.shape.threads);
  const int64_t rows_per_cta = l.shape.threads / l.shape.tpr * l.shared_rows;
  const int64_t row_groups = ceil_div(L.y.rows, rows_per_cta);
  if (params) {
    const int64_t bound =
        std::max(kScratchFloor, L.y.rows * n * static_cast<int64_t>(sizeof(T)) / 4);
    // Scratch of one CTA (or cluster), whose row groups fill one row per array together.
    const int64_t per_unit = n * param_arrays * static_cast<int64_t>(sizeof(float));
    // Streamed rows sum in shared memory where a CTA's sums fit (two CTAs per multiprocessor,
    // as the launch bounds ask, or else one; 1 KiB stays for the kernel's static shared
    // memory). Where they fit in none, column_sums_kernel sums them in a pass of its own (a
    // read-modify-write of the CTA's scratch rows in global memory per row, 8 bytes per
    // element and array, ran several times slower).
    const int64_t room = dev.smem_optin - 1024;
    const int fit = per_unit <= room / 2 ? 2 : per_unit <= room ? 1 : 0;
    if (l.shape.path == RowPath::kStream && fit == 0) {
      l.column_tiles = ceil_div(n, int64_t{kWarpSize} * vec);
      // Enough CTAs to fill the GPU a few times over, each slice a scratch row within bound.
      const int64_t slices =
          std::min({ceil_div(sm_count * tuned(kColumnSumsCtasPerSm, key), l.column_tiles),
                    ceil_div(L.y.rows, int64_t{kColumnSlices}),
                    bound / (n * param_arrays * int64_t{sizeof(float)})});
      // backward_kernel then writes grad_x only: no scratch rows bound its grid.
      l.grid = std::max<int64_t>(1, std::min(row_groups, max_units));
      l.partial_rows = L.y.rows == 0 ? 0 : std::max<int64_t>(1, slices);
      return l;
    }
    max_units = std::min(max_units, std::max<int64_t>(1, bound / per_unit));
    if (l.shape.path == RowPath::kStream) {
      l.smem_sums_bytes = per_unit;
      max_units = std::min(max_units, int64_t{sm_count} * fit);  // the CTAs resident at once
    }
  }
  const int64_t units = std::max<int64_t>(1, std::min(row_groups, max_units));
  l.grid = units * l.shape.cluster;
  l.partial_rows = L.y.rows == 0 ? 0 : units;
  return l;
}

template <class Op, typename T, int VEC, bool kParams>
cudaError_t launch_kernel(const T* y, const T* dy, T* dx, const BackwardRows& L, const Op& op,
                          const Launch& l, const Partials& part, cudaStream_t stream) {
  if (l.shape.path == RowPath::kStream) {
    const auto kernel = backward_kernel<Op, T, VEC, path_nv<Op>(RowPath::kStream, VEC, kParams),
                                        RowPath::kStream, kParams, false>;
    Partials p = part;
    p.smem_sums = l.smem_sums_bytes > 0;
    if (p.smem_sums) {
      const cudaError_t err = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(l.smem_sums_bytes));
      if (err != cudaSuccess) return err;
    }
    kernel<<<static_cast<unsigned>(l.grid), l.shape.threads, l.smem_sums_bytes, stream>>>(
        y, dy, dx, L, op, l.shape.tpr, 1, p);
    return cudaGetLastError();
  }
  // resident_backward_units, called by plan_launch, has lifted the shared memory limit and
  // allowed the cluster size.
  const auto resident = [&](auto path_const, auto cache_const, auto rows_const) {
    constexpr RowPath kPath = decltype(path_const)::value;
    constexpr bool kCache = decltype(cache_const)::value;
    constexpr int kR = decltype(rows_const)::value;
    constexpr int NV = path_nv<Op>(kPath, VEC, kParams);
    const auto kernel = with_cta<Op, kPath, VEC>(l.shape.threads, [](auto cta) {
      return backward_kernel<Op, T, VEC, NV, kPath, kParams, kCache, kR, decltype(cta)::value>;
    });
    const int64_t smem = resident_backward_smem<Op>(kPath, VEC, NV, l.shape.threads, kParams,
                                                    kCache ? Op::kColumnValues : 0, kR);
    return launch_clustered(kernel, l.grid, l.shape.threads, static_cast<size_t>(smem),
                            l.shape.cluster, stream, y, dy, dx, L, op, l.shape.tpr, l.shape.cluster,
                            part);
  };
  using Shared = PathTag<RowPath::kShared>;
  using Registers = PathTag<RowPath::kRegisters>;
  if constexpr (VEC > 1) {
    if (l.cache) {  // (plan_launch sets it only where the op caches on the path)
      if constexpr (Op::template kCacheColumns<RowPath::kShared>) {
        if constexpr (Op::kSharedRows > 1)
          if (l.shape.path == RowPath::kShared && l.shared_rows > 1)
            return resident(Shared{}, std::true_type{},
                            std::integral_constant<int, Op::kSharedRows>{});
        if (l.shape.path == RowPath::kShared) return resident(Shared{}, std::true_type{}, One{});
      }
      if constexpr (Op::template kCacheColumns<RowPath::kRegisters>)
        if (l.shape.path == RowPath::kRegisters)
          return resident(Registers{}, std::true_type{}, One{});
    }
    if (l.shape.path == RowPath::kShared) return resident(Shared{}, std::false_type{}, One{});
    if constexpr (has_wide_registers<Op>()) {
      if (l.shape.path == RowPath::kWideRegisters)
        return resident(PathTag<RowPath::kWideRegisters>{}, std::false_type{}, One{});
      if (l.shape.path == RowPath::kWideCluster)
        return resident(PathTag<RowPath::kWideCluster>{}, std::false_type{}, One{});
    }
    if constexpr (Op::kClusterRegisters)
      if (l.shape.path == RowPath::kCluster)
        return resident(PathTag<RowPath::kCluster>{}, std::false_type{}, One{});
  }
  return resident(Registers{}, std::false_type{}, One{});
}

// Launches the path `l` names; with parameter gradients when `part` holds any.
template <class Op, typename T>
cudaError_t launch_paths(const T* y, const T* dy, T* dx, const BackwardRows& L, const Op& op,
                         const Launch& l, const Partials& part, cudaStream_t stream) {
  constexpr int VEC = kVec<T>;
  if constexpr (Op::kHasParams) {
    if (part.w != nullptr || part.b != nullptr)
      return l.vec ? launch_kernel<Op, T, VEC, true>(y, dy, dx, L, op, l, part, stream)
                   : launch_kernel<Op, T, 1, true>(y, dy, dx, L, op, l, part, stream);
  }
  return l.vec ? launch_kernel<Op, T, VEC, false>(y, dy, dx, L, op, l, part, stream)
               : launch_kernel<Op, T, 1, false>(y, dy, dx, L, op, l, part, stream);
}

// Whether y's, dy's and dx's (nullptr: not written) rows are 16-byte aligned with col_stride 1.
inline bool all_rows_aligned(const void* y, const void* dy, const void* dx, const BackwardRows& L,
                             int64_t elem) {
  return L.y.col_stride == 1 && L.grad.col_stride == 1 && rows_aligned(y, L.y.row, elem, 16) &&
         rows_aligned(dy, L.grad.row, elem, 16) &&
         (dx == nullptr || (L.grad_x.col_stride == 1 && rows_aligned(dx, L.grad_x.row, elem, 16)));
}

}  // namespace mti
