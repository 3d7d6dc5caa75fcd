// The forward kernel of the row-wise ops (softmax / log_softmax, LayerNorm, RMSNorm) and its
// launch: a row is read into registers, reduced to a per-row state, transformed and written
// back over itself. The op-specific part is a functor (the "Op" below).
//
// Paths (RowPath, paths.h), chosen by launch_rows():
//  - kRegisters: the row stays in registers from its read to its write, held by a group of
//    <= 32 lanes (several rows per CTA) or by a whole CTA of up to kMaxThreads threads.
//  - kCluster: the same for longer rows, held by a CTA of exactly kMaxThreads threads or, on
//    sm_90+, by a cluster of them that reduce over distributed shared memory.
//  - kStashed: kCluster with each thread holding as much of the row again in shared memory.
//  - kStream: rows too long for the above: the row is read once to reduce and once more to
//    write.
// With col_stride 1, 16-byte aligned rows (and weight/bias, mask rows) and N a multiple of VEC
// every access moves 16 bytes (VEC elements); anything else (col_stride != 1, unaligned rows,
// odd N) runs the same paths with VEC = 1, element by element.
//
// Op concept (see softmax_forward.cu and norm_forward.cu):
//   using State;                    reduction state, see reduce.cuh
//   static constexpr float kPad;    value of a column that is not read: past the row's end or
//                                   past its causal limit. local() must treat it as absent.
//   static constexpr bool kKeepsX;  prepare() and local() leave z equal to x (as floats), so
//                                   a stashed step may be parked in shared memory as T
//   static constexpr const Tunable& kCtaRowValues;   the table of the values per thread
//                                   where a CTA of up to kMaxThreads threads holds a row
//   static constexpr const Tunable& kRowsPerCta;     the table of the row groups per CTA
//                                   of its single-CTA launches (see rows_per_unit)
//   struct Row { int64_t load_end; ... };   per-row context; columns >= load_end are not read
//   Row row(int64_t r, const T* x_row) const;    x_row: the row's first element
//   template <int VEC> using Aux;   per-vector side input read along with x (mask values)
//   void load_aux<VEC>(Aux<VEC>&, const Row&, int64_t c0, int cnt) const;
//       the side input of the vector at c0, of which the elements < cnt will be used (none
//       when cnt is 0: read nothing then)
//   void prepare<VEC>(float (&v)[VEC], const Aux<VEC>&, const Row&, int cnt) const;
//       x -> z for the elements < cnt
//   State local<NV, VEC>(float (&z)[NV][VEC], const Row&, Valid valid) const;
//       the state of one thread's chunk; valid(k, j) tells whether z[k][j] is a column of the
//       row. May rewrite z into the form output() expects (softmax stores exp(z - local max)).
//   struct Fin; Fin finish(const State& total, const Row&) const;   row constants
//   struct Out; Out out(const Fin&, const State& chunk) const;  constants for one chunk
//   static constexpr int kParams;   per-column inputs of output() (a norm's weight and bias)
//   ColumnParams<T, kParams> params;
//   void output<VEC>(float (&v)[VEC], const Out&, const ParamValues<kParams, VEC>&) const;
//       z -> y, a whole vector, given the params of its columns
//   void save(int64_t row, const Fin&) const;                   per-row side output (rstd)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/rowwise/forward_steps.cuh"

namespace mti {

// Whether the op reads nothing but x (softmax_ and log_softmax_ without a mask).
template <class Op, typename T>
constexpr bool kReadsOnlyX =
    Op::kParams == 0 && std::is_same_v<typename Op::template Aux<kVec<T>>, NoAux>;

// One kernel for every path. kRegisters and kStream: a row belongs to a group of `tpr`
// threads; tpr <= 32 is a group of lanes (blockDim.x / tpr rows per CTA), tpr > 32 means
// tpr == blockDim.x and the row belongs to the CTA. Thread t of the group owns the row's
// vectors t, t + tpr, t + 2 tpr, ... kCluster: blockDim.x == kMaxThreads and the row belongs
// to a cluster of `cluster` CTAs (1 without clusters); CTA `rank` owns the rank-th run of
// kMaxThreads * NV vectors, in which thread t owns t, t + kMaxThreads, ... Either way a warp
// reads 32 neighbouring vectors at a time. A step is NV vectors per thread: resident rows
// are one step, streamed rows loop over steps twice. The grid strides over rows (groups of
// rows, clusters). The CTAs resident on an SM overlap one another's loads with their
// reductions, so no CTA prefetches its next row (which ran slower, for clusters too but at
// the longest rows).
//
// kStashed is kCluster with a CTA's run twice as long (kMaxThreads * NV * 2 vectors), which
// each thread reads and reduces as two steps, the first parked in shared memory meanwhile
// (after the cached params; see StashOf for its type).
//
// kCached (ops with Op::kParams; not on the streaming path): the first kCached of the
// thread's param vectors (one per vector it holds of a row and param, param 0's first, then
// in the order of the row's steps; their value where absent) are copied
// into shared memory once (cache_param, row_smem_bytes() of dynamic shared memory) and read
// from there in every row's write loop, the others from global memory (see ParamReader).
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached>
__global__ void __launch_bounds__(kMaxThreads,
                                  forward_min_ctas(sizeof(T), VEC* NV, kPath, kReadsOnlyX<Op, T>))
    row_kernel(T* __restrict__ x, const RowLayout layout, const Op op, const int tpr,
               const int cluster) {
  using State = typename Op::State;
  using Vec = Packed<T, VEC>;
  constexpr bool kStream = kPath == RowPath::kStream;
  constexpr bool kClusterRows = spans_cluster(kPath);
  constexpr int kSteps = held_steps(kPath);
  constexpr int kHeldNV = NV * kSteps;  // vectors a thread holds of a row
  constexpr int kStride = kClusterRows ? kMaxThreads : 0;
  static_assert(kCached == 0 || !kStream, "a streamed row's columns change from step to step");
  // A resident row fits on chip, so its columns fit in an int; a streamed one may not.
  using Col = std::conditional_t<kStream, int64_t, int>;
  using Cursor = StepCursor<Col, kStride>;
  __shared__ State warp_totals[2][kMaxWarps];
  __shared__ ClusterExchange<State> exchange;
  // One name and type for every instantiation's dynamic shared memory, as CUDA requires.
  extern __shared__ __align__(16) unsigned char dynamic_smem[];

  constexpr bool kPerWarp = !kClusterRows;  // see read_step
  const bool cta_rows = kClusterRows || tpr > kWarpSize;
  const int rank = static_cast<int>(blockIdx.x) % cluster;
  const int lane_group = cta_rows ? static_cast<int>(blockDim.x) : tpr;
  const int t = kClusterRows ? rank * kMaxThreads * kHeldNV + static_cast<int>(threadIdx.x)
                             : static_cast<int>(threadIdx.x) % lane_group;
  const int rows_per_cta = cta_rows ? 1 : static_cast<int>(blockDim.x) / tpr;
  const int sub_row = cta_rows ? 0 : static_cast<int>(threadIdx.x) / tpr;
  const int64_t col_stride = VEC == 1 ? layout.col_stride : 1;
  const int64_t row_groups = ceil_div(layout.rows, rows_per_cta);
  const int64_t group_stride = gridDim.x / cluster;

  if (cluster > 1) {
    cluster_exchange_init(exchange);
    cluster_sync();
  }
  Vec* const param_slots = reinterpret_cast<Vec*>(dynamic_smem) + threadIdx.x;
  using Stash = StashOf<Op, T>;
  StashSlot<Stash>* const stash = reinterpret_cast<StashSlot<Stash>*>(
                                      reinterpret_cast<Vec*>(dynamic_smem) + kCached * blockDim.x) +
                                  threadIdx.x;
  constexpr int kStashSlots = NV * VEC * sizeof(Stash) / 16;  // per stashed step and thread
  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i * kHeldNV < kCached; ++i)
      cache_param(param_slots + i * kHeldNV * blockDim.x, static_cast<int>(blockDim.x),
                  std::min(kHeldNV, kCached - i * kHeldNV), op.params.ptr[i], op.params.absent[i],
                  Cursor{t, lane_group}, static_cast<Col>(layout.n));
    cp_async_commit();
  }
  const ParamReader<kHeldNV, VEC, T, Op::kParams, kCached> params{op.params, param_slots,
                                                                  static_cast<int>(blockDim.x)};
  unsigned rows_done = 0;  // by this thread: picks the reduction buffers
  for (int64_t g = blockIdx.x / cluster; g < row_groups; g += group_stride) {
    const int64_t r = g * rows_per_cta + sub_row;
    const bool active = r < layout.rows;
    T* row = x;
    typename Op::Row rc{};
    if (active) {
      row += layout.row.offset(r);
      rc = op.row(r, row);
    }
    // Inactive threads (past the last row) take part in the reductions with empty chunks.
    const Col load_end = active ? static_cast<Col>(rc.load_end) : 0;
    const Col end = active ? static_cast<Col>(layout.n) : 0;
    const GlobalVectors<VEC, T> from_global{row, col_stride};

    float z[NV][VEC];
    State mine;
    State held[kSteps];  // the state of each step held (not kStream)
    if constexpr (kStream) {
      const Col step_vecs = static_cast<Col>(NV) * lane_group;
      mine = State::identity();
      const Col steps = ceil_div(ceil_div(load_end, VEC), step_vecs);
      for (Col s = 0; s < steps; ++s) {
        const State chunk = read_step<kPerWarp>(
            z, op, from_global, rc, Cursor{s * step_vecs + t, lane_group}, load_end, end);
        mine = s == 0 ? chunk : State::combine(mine, chunk);
      }
    } else {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        if (s > 0) stash_step<Stash>(stash + (s - 1) * kStashSlots * blockDim.x, blockDim.x, z);
        held[s] = read_step<kPerWarp>(z, op, from_global, rc,
                                      Cursor{t + s * NV * lane_group, lane_group}, load_end, end);
        mine = s == 0 ? held[0] : State::combine(mine, held[s]);
      }
    }

    // A whole warp's width as a constant: its steps then test and branch nothing. Chunks held
    // in registers (at most a thread's registers' worth of values) may take the state's own
    // first level; a streamed row's chunks are as long as the row makes them, and the
    // stashed kernels have no register to spare (bf16 softmax's then spilled on sm_80).
    State total;
    if constexpr (kStream || kPath == RowPath::kStashed)
      total = cta_rows ? warp_allreduce(mine, kWarpSize) : warp_allreduce(mine, tpr);
    else
      total = cta_rows ? warp_allreduce_chunks(mine, kWarpSize) : warp_allreduce_chunks(mine, tpr);
    if (cta_rows) total = cta_allreduce(total, warp_totals[rows_done % 2]);
    if (cluster > 1) total = cluster_allreduce(total, exchange, rows_done, rank, cluster);
    ++rows_done;
    const typename Op::Fin fin = op.finish(total, rc);
    if (active && t == 0) op.save(r, fin);

    if constexpr (kStream) {
      const Col step_vecs = static_cast<Col>(NV) * lane_group;
      const Col steps = ceil_div(ceil_div(end, VEC), step_vecs);
      for (Col s = 0; s < steps; ++s) {
        const Cursor at{s * step_vecs + t, lane_group};
        const State chunk = read_step<kPerWarp>(z, op, from_global, rc, at, load_end, end);
        write_step(z, op, op.out(fin, chunk), params, row, at, col_stride, end);
      }
    } else {
      if constexpr (kCached > 0) cp_async_wait<0>();  // the cached params are in
#pragma unroll
      for (int s = kSteps - 1; s >= 0; --s) {
        if (s < kSteps - 1)
          unstash_step<Stash>(z, stash + s * kStashSlots * blockDim.x, blockDim.x);
        const typename Op::Out out = op.out(fin, held[s]);
        const Cursor at{t + s * NV * lane_group, lane_group};
        // A stashed row's step s reads the params of the thread's vectors s * NV on. (The
        // one-step kernels take the reader itself: fp32 RMSNorm's cluster kernel spilled on
        // sm_75 with the step's wrapper.)
        if constexpr (kSteps == 1)
          write_step(z, op, out, params, row, at, col_stride, end);
        else
          write_step(
              z, op, out, [&](int k, Col c0) { return params(s * NV + k, c0); }, row, at,
              col_stride, end);
      }
    }
  }
  // No CTA leaves while another may still send it a total.
  if (cluster > 1) cluster_sync();
}

// ---------------------------------------------------------------------------- host side

// What the launchers of one call share.
struct RowCall {
  int device = 0;
  DeviceInfo dev;
  TuningKey key;  // the GPU and the call, for the tuning tables
  cudaStream_t stream = nullptr;
};

// Dynamic shared memory of a launch of row_kernel: the cached param vectors, then the stashed
// steps.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached>
constexpr size_t row_smem_bytes(int threads) {
  return (static_cast<size_t>(kCached) * sizeof(Packed<T, VEC>) +
          static_cast<size_t>(held_steps(kPath) - 1) * NV * VEC * sizeof(StashOf<Op, T>)) *
         threads;
}

// resident_units() of row_kernel.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached>
int row_units(const RowCall& call, int threads, int cluster) {
  return resident_units<row_kernel<Op, T, VEC, NV, kPath, kCached>>(
      call.device, threads, cluster, row_smem_bytes<Op, T, VEC, NV, kPath, kCached>(threads),
      call.dev.sm_count);
}

// Row groups that each CTA (cluster) of launch_row_kernel's grid takes on, 0 for as many as
// the CTAs that fit on the GPU at once leave to each (a grid of those, striding over the
// rows). A CTA (cluster) per group or two lets the hardware start a new one on an SM whenever
// one finishes, where resident ones striding over the rows leave some SMs a row more than
// others at the end; but each CTA then pays its setup (cached params, a cluster's exchange),
// so only CTAs that cache at most a row's param vectors (the op's kRowsPerCta) and clusters of
// two that cache nothing (kRowsPerPair) take a set number. `cached`: param vectors each thread
// caches; `nv`: the vectors it holds of a row (both steps of a stashed one).
inline int64_t rows_per_unit(const Tunable& rows_per_cta, const TuningKey& key, int cluster,
                             int cached, int nv) {
  if (cluster == 1) return cached <= nv ? tuned(rows_per_cta, key) : 0;
  return cluster == 2 && cached == 0 ? tuned(kRowsPerPair, key) : 0;
}

// Launches row_kernel on the grid that rows_per_unit() asks for.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached = 0>
cudaError_t launch_row_kernel(T* x, const RowLayout& layout, const Op& op, int threads, int tpr,
                              int cluster, const RowCall& call) {
  const int64_t rows_per_cta = tpr > kWarpSize ? 1 : threads / tpr;
  const int64_t row_groups = ceil_div(layout.rows, rows_per_cta);
  const int64_t per_unit =
      rows_per_unit(Op::kRowsPerCta, call.key, cluster, kCached, NV * held_steps(kPath));
  int64_t units = 0;
  if (per_unit > 0) {
    units = std::min<int64_t>(ceil_div(row_groups, per_unit),
                              std::numeric_limits<int>::max() / cluster);
  } else {
    const int resident = row_units<Op, T, VEC, NV, kPath, kCached>(call, threads, cluster);
    units = std::min<int64_t>(row_groups, std::max(resident, call.dev.sm_count / cluster));
  }
  return launch_clustered(row_kernel<Op, T, VEC, NV, kPath, kCached>, units * cluster, threads,
                          row_smem_bytes<Op, T, VEC, NV, kPath, kCached>(threads), cluster,
                          call.stream, x, layout, op, tpr, cluster);
}

// The counts of cached param vectors that launch_caching tries after `cached`: from all the
// vectors of p params (p * nv) to all but a quarter of the last one's, then to p - 1 params'.
constexpr int fewer_cached(int cached, int nv) {
  return cached % nv != 0 ? cached / nv * nv : nv >= 4 ? cached - nv / 4 : cached - nv;
}

// launch_row_kernel() for rows that belong to a cluster (of one CTA or more), with the first
// kCached (at most) of each thread's param vectors cached: only params up to the last one
// given, and as many vectors as fit in shared memory without fewer CTAs resident than with
// none (with fewer, less of the rows is in flight; of fp32 LayerNorm's bias, all but a quarter
// fits beside the weight on two CTAs per SM). A row on one CTA caches nothing where more
// params are given than kCtaCachedParams allows: each thread then reads its params from L1 in
// the write loop. Shorter rows (launch_rows' other paths) cache nothing: their params stay in
// L1.
template <class Op, typename T, int VEC, int NV, RowPath kPath,
          int kCached = Op::kParams * NV * held_steps(kPath)>
cudaError_t launch_caching(T* x, const RowLayout& layout, const Op& op, int cluster,
                           const RowCall& call) {
  constexpr int kHeldNV = NV * held_steps(kPath);  // vectors a thread holds of a row
  if (cluster == 1 && params_to_cache(op.params) > tuned(kCtaCachedParams, call.key))
    return launch_row_kernel<Op, T, VEC, NV, kPath>(x, layout, op, kMaxThreads, kMaxThreads,
                                                    cluster, call);
  if constexpr (kCached > 0) {
    const int units = params_to_cache(op.params) * kHeldNV >= kCached
                          ? row_units<Op, T, VEC, NV, kPath, kCached>(call, kMaxThreads, cluster)
                          : 0;
    if (units > 0 && units >= row_units<Op, T, VEC, NV, kPath, 0>(call, kMaxThreads, cluster))
      return launch_row_kernel<Op, T, VEC, NV, kPath, kCached>(x, layout, op, kMaxThreads,
                                                               kMaxThreads, cluster, call);
    return launch_caching<Op, T, VEC, NV, kPath, fewer_cached(kCached, kHeldNV)>(x, layout, op,
                                                                                 cluster, call);
  } else {
    return launch_row_kernel<Op, T, VEC, NV, kPath>(x, layout, op, kMaxThreads, kMaxThreads,
                                                    cluster, call);
  }
}

// Calls f(std::integral_constant<int, count>{}) for a count of 1 to kMost.
template <int kMost, class F>
cudaError_t with_count(int64_t count, F f) {
  if constexpr (kMost > 1)
    if (count < kMost) return with_count<kMost - 1>(count, f);
  return f(std::integral_constant<int, kMost>{});
}

// The vectors a thread holds of a row of `vecs` vectors that a CTA holds on the register path:
// `tuned` if whole warps then hold the row exactly, else the count nearest it (the larger of two
// as near; from 3 to twice `tuned`, at most `most`) at which whole warps of at most kMaxThreads
// do; else `tuned`. A warp with a thread whose vectors reach past the row's end takes the general path,
// which tests every element (16-bit LayerNorm at n = 1536-7168 ran 1.2-1.5x slower so).
inline int64_t even_row_nv(int64_t vecs, int64_t tuned, int64_t most) {
  const auto exact = [&](int64_t nv) {
    return nv >= 3 && nv <= std::min(most, 2 * tuned) && vecs % (nv * kWarpSize) == 0 &&
           vecs / nv <= kMaxThreads;
  };
  if (vecs % (tuned * kWarpSize) == 0) return tuned;
  for (int64_t d = 1; d < most; ++d) {
    if (exact(tuned + d)) return tuned + d;
    if (exact(tuned - d)) return tuned - d;
  }
  return tuned;
}

// Picks the path (see the top of this file) and launches it. `aligned`: col_stride is 1 and
// every row start, and every per-column side input the op reads by vectors, is 16-byte
// aligned; with n a multiple of VEC too, the kernels move 16 bytes per access.
template <class Op, typename T>
cudaError_t launch_rows(T* x, const RowLayout& layout, const Op& op, bool aligned,
                        cudaStream_t stream) {
  if (layout.rows == 0 || layout.n == 0) return cudaSuccess;
  RowCall call;
  const cudaError_t err = current_device(&call.device, &call.dev);
  if (err != cudaSuccess) return err;
  const int64_t n = layout.n;
  call.key = tuning_key(call.dev, sizeof(T), n);
  call.stream = stream;

  if (!aligned || n % kVec<T> != 0) {
    if (n <= kWarpSize * kScalarNV) {
      const int tpr = static_cast<int>(next_pow2(ceil_div(n, kScalarNV)));
      return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kRegisters>(
          x, layout, op, kSmallRowThreads, tpr, 1, call);
    }
    if (n <= int64_t{kMaxThreads} * kScalarNV) {
      const int threads = static_cast<int>(round_up(ceil_div(n, kScalarNV), kWarpSize));
      return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kRegisters>(x, layout, op, threads,
                                                                         threads, 1, call);
    }
    return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kStream>(x, layout, op, kMaxThreads,
                                                                    kMaxThreads, 1, call);
  }

  constexpr int VEC = kVec<T>;
  constexpr int kWarpNV = kWarpRegs / VEC;  // vectors per thread: 8 for fp32, 4 for 16-bit
  constexpr int kCtaNV = kCtaRegs / VEC;
  constexpr int kCtaRowNV = cta_row_regs(sizeof(T)) / VEC;
  const int64_t vecs = ceil_div(n, VEC);
  // Launches the register path with `nv` (1 to kMost) vectors a thread.
  const auto launch_registers = [&](auto most, int64_t nv, int threads, int tpr) {
    return with_count<decltype(most)::value>(nv, [&](auto nv_const) {
      return launch_row_kernel<Op, T, VEC, decltype(nv_const)::value, RowPath::kRegisters>(
          x, layout, op, threads, tpr, 1, call);
    });
  };
  if (vecs <= kWarpSize * kWarpNV) {
    // Up to a warp per row. The fewest lanes that hold the row with at most kWarpNV vectors
    // each: more bytes in flight per thread and fewer shuffles than spreading the row thin;
    // as many vectors each as hold the row exactly where the lanes share it evenly.
    const int tpr = static_cast<int>(next_pow2(ceil_div(vecs, kWarpNV)));
    const int64_t nv = vecs % tpr == 0 ? vecs / tpr : next_pow2(ceil_div(vecs, tpr));
    return launch_registers(std::integral_constant<int, kWarpNV>{}, nv, kSmallRowThreads, tpr);
  }
  // A CTA per row, as many threads as it takes at the op's tuned vectors a thread (or a count
  // near it at which whole warps hold the row exactly, see even_row_nv). Rows that would take
  // all kMaxThreads threads at kCtaNV vectors each are what the cluster path's CTA holds: for
  // ops with params kParamsCtaRowThreads says up to which length they take a CTA per row here.
  const int64_t cta_row_nv =
      std::clamp<int64_t>(tuned(Op::kCtaRowValues, call.key) / VEC, 1, kCtaRowNV);
  const int64_t cta_row_threads =
      Op::kParams > 0 && cta_row_nv == kCtaNV
          ? std::min<int64_t>(kMaxThreads, tuned(kParamsCtaRowThreads, call.key))
          : kMaxThreads;
  if (vecs <= cta_row_threads * cta_row_nv) {
    const int64_t nv = even_row_nv(vecs, cta_row_nv, kCtaRowNV);
    const int threads = static_cast<int>(round_up(ceil_div(vecs, nv), kWarpSize));
    return launch_registers(std::integral_constant<int, kCtaRowNV>{}, nv, threads, threads);
  }
  // A CTA, or on sm_90+ a cluster of up to max_cluster() CTAs, per row, kCtaNV vectors per
  // thread in registers, and past what registers hold as much again stashed (kStashed);
  // streamed when no cluster holds the row.
  const int64_t cta_vecs = int64_t{kMaxThreads} * kCtaNV;
  const int most = max_cluster(call.dev, call.key);
  // The smallest cluster whose CTAs of `path` hold the row; 0 if none can run here.
  const auto cluster_for = [&](auto path) {
    constexpr RowPath kPath = decltype(path)::value;
    int cluster = 1;
    while (cluster <= most && vecs > cluster * held_steps(kPath) * cta_vecs) cluster *= 2;
    const bool fits =
        cluster <= most && row_units<Op, T, VEC, kCtaNV, kPath, 0>(call, kMaxThreads, cluster) > 0;
    return fits ? cluster : 0;
  };
  // 16-bit rows of ops without params stash, and so do RMSNorm's: x stashed as itself
  // (StashOf) takes 32 KiB per CTA, beside which the CTA's weight (twice the columns, 64 KiB)
  // stays cached with two CTAs per SM. LayerNorm's two params do not fit beside the stash
  // whole. fp32 rows of ops that read nothing but x stash (with a mask, two steps spilled)
  // where that leaves at most kStashMaxCluster CTAs a row.
  constexpr bool kStash16 =
      sizeof(T) == 2 && (Op::kParams == 0 || (Op::kParams == 1 && Op::kKeepsX));
  constexpr bool kStash32 = sizeof(T) == 4 && kReadsOnlyX<Op, T>;
  if constexpr (kStash16 || kStash32) {
    if (vecs > cta_vecs) {
      const int cluster = cluster_for(PathTag<RowPath::kStashed>{});
      if (cluster > 0 && cluster <= tuned(kStashMaxCluster, call.key))
        return launch_caching<Op, T, VEC, kCtaNV, RowPath::kStashed>(x, layout, op, cluster, call);
    }
  }
  if (const int cluster = cluster_for(PathTag<RowPath::kCluster>{}))
    return launch_caching<Op, T, VEC, kCtaNV, RowPath::kCluster>(x, layout, op, cluster, call);
  return launch_row_kernel<Op, T, VEC, kStreamRegs / VEC, RowPath::kStream>(
      x, layout, op, kMaxThreads, kMaxThreads, 1, call);
}

}  // namespace mti
