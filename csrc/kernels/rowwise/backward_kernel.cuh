// The backward kernel of the row-wise ops, from the forward's output y: softmax /
// log_softmax and LayerNorm / RMSNorm (with their weight and bias gradients, param_sums.h).
// Its launch is in backward.cuh.
//
// One kernel serves both ops through a functor (SoftmaxBackwardOp in softmax_backward.cu,
// NormBackwardOp in norm_backward_op.cuh). A row belongs to a group of `tpr` threads: tpr <=
// 32 lanes, a run of whole warps (both with as many rows per CTA as fit in kMaxThreads, but
// where an op's rows take a CTA each: OpChoices::row_per_cta), a CTA of up to
// kLargeCtaThreads, or on sm_90+ a cluster of `cluster` CTAs of kMaxThreads (or
// kLargeCtaThreads) that reduce over distributed shared memory (reduce.cuh). Thread t of the
// group owns the row's vectors t, t + tpr, t + 2 tpr, ... (so a warp reads 32 neighbouring
// vectors at a time), NV of them per step; in a cluster, CTA `rank` owns the rank-th run of
// tpr * NV vectors. The grid strides over groups of rows (clusters), or has a CTA per group
// where grid_waves() says so. Paths (paths.h):
//  - kRegisters: rows that a CTA holds in registers, one step, read once. Vector rows
//    (16-byte accesses, see below) are prefetched: the thread's vectors of its next row are
//    copied into shared memory (cp.async) while the current row is reduced and written
//    (but softmax's, which take a CTA per row group and so have no next row: see
//    staging_buffers).
//  - kWideRegisters: the same for softmax's rows that a CTA holds only with more elements per
//    thread (16-bit rows, softmax_wide_elems).
//  - kCluster: the same for softmax's longer vector rows, held by the registers of a cluster
//    of CTAs on sm_90+ (where its cluster_registers table says so); kWideCluster with the
//    wide paths' elements per thread, for rows that no cluster holds otherwise.
//  - kShared: other longer vector rows, each thread's vectors of y and dy copied into shared
//    memory (cp.async), reduced from there vector by vector and grad_x computed from the same
//    copy, so y and dy are read from DRAM once; on sm_90+ a cluster of CTAs holds a row. Two
//    buffers: the next row's vectors are on their way while the current row is reduced and
//    written. Slower than registers where those hold the row (a shared memory read per vector
//    and pass, and half the rows in flight). 16-bit norm rows on the largest clusters take two
//    rows at a time (NormBackwardOp::kSharedRows).
//  - kStream: rows longer than a cluster holds; a first pass over the steps reduces, a second
//    reads y and grad again (from L2 where the row is still there) and writes.
// With every col_stride 1, 16-byte aligned rows (and mask rows, weight, bias) and n a multiple
// of VEC, accesses move 16 bytes (VEC elements); otherwise the same kernel runs with VEC = 1.
//
// grad_weight / grad_bias (LayerNorm, RMSNorm): each CTA (cluster) sums grad * t and grad over
// the rows it handles, per column, into its own fp32 row of a scratch [P, n] (P = CTAs, or
// clusters, the grid holds at once): in registers on the resident paths (a thread owns the
// same columns in every row; the row groups of a CTA add theirs at the end; the CTAs of a
// cluster each fill their own columns of the cluster's row), in shared memory on the streaming
// path, or in a column pass of its own (column_sums_kernel) where those sums fit in no CTA's
// shared memory.
#pragma once

#include <type_traits>

#include "kernels/rowwise/framework.cuh"
#include "kernels/rowwise/param_sums.h"

namespace mti {

// Vectors (of vec elements) per thread and step of `path`.
template <class Op>
constexpr int path_nv(RowPath path, int vec, bool params) {
  if (vec == 1) return kScalarNV;
  switch (path) {
    case RowPath::kRegisters:
    case RowPath::kCluster:
      return (params ? kParamElems : Op::kResidentElems) / vec;
    case RowPath::kWideRegisters:
    case RowPath::kWideCluster:
      if constexpr (Op::kClusterRegisters) return Op::kWideElems / vec;
      break;
    case RowPath::kShared:
      return (params || Op::template kCacheColumns<RowPath::kShared>) &&
                     kParamElems / vec < kStagedVectors
                 ? kParamElems / vec
                 : kStagedVectors;
    case RowPath::kStashed:  // the forward's
    case RowPath::kStream:
      break;
  }
  return kStreamElems / vec;
}

// Whether Op holds some rows on the wide register paths (16-bit softmax).
template <class Op>
constexpr bool has_wide_registers() {
  if constexpr (Op::kClusterRegisters)
    return Op::kWideElems > Op::kResidentElems;
  else
    return false;
}

// Whether the rows of `path` take a CTA per row group (grid_waves): softmax's register rows.
template <class Op>
__host__ __device__ constexpr bool always_cta_per_group(RowPath path) {
  return path == RowPath::kRegisters && !Op::kHasParams;
}

// Staging buffers of y's and dy's vectors that backward_kernel's `path` keeps in shared
// memory (see there): two on the shared path, one for the register paths' prefetch of vector
// rows, none for scalar or streamed rows, nor where always_cta_per_group: no CTA has a next
// row to prefetch there, and staging the row it has only delays it.
template <class Op>
__host__ __device__ constexpr int staging_buffers(RowPath path, int vec) {
  if (vec == 1 || path == RowPath::kStream) return 0;
  if (always_cta_per_group<Op>(path)) return 0;
  return path == RowPath::kShared ? 2 : 1;
}

// A thread's column values (K arrays of VEC floats per vector it owns, see NormBackwardOp::
// columns), cached in shared memory after the staging buffers: array i of its vector k in
// chunks of up to 4 floats, chunk h at slots[((i * NV + k) * VEC / kChunk + h) * stride], so
// that a warp's 16-byte reads are contiguous. Each thread reads only the slots it wrote: no
// barrier.
template <int K, int NV, int VEC>
struct ColumnCache {
  static constexpr int kChunk = VEC < 4 ? VEC : 4;
  using Chunk = Packed<float, kChunk>;
  Chunk* slots;  // this thread's first slot
  int stride;

  __device__ __forceinline__ void store(int k, const ParamValues<K, VEC>& p) const {
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
      for (int h = 0; h < VEC / kChunk; ++h) {
        Chunk c;
#pragma unroll
        for (int j = 0; j < kChunk; ++j) c.v[j] = p.v[i][h * kChunk + j];
        slots[((i * NV + k) * VEC / kChunk + h) * stride] = c;
      }
  }
  __device__ __forceinline__ ParamValues<K, VEC> load(int k) const {
    ParamValues<K, VEC> p;
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
      for (int h = 0; h < VEC / kChunk; ++h) {
        const Chunk c = slots[((i * NV + k) * VEC / kChunk + h) * stride];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) p.v[i][h * kChunk + j] = c.v[j];
      }
    return p;
  }
};

// Dynamic shared memory of a resident launch: its staging buffers (of `rows` rows each, see
// backward_kernel's kR) and its column cache (`column_values` arrays, 0 without one), and
// with parameter gradients at least the CTA's per-thread column sums (the rows of a CTA add
// theirs there at the end, see backward_kernel; only the scalar path, which stages nothing,
// needs more).
template <class Op>
constexpr int64_t resident_backward_smem(RowPath path, int vec, int nv, int threads, bool params,
                                         int column_values, int rows) {
  const int64_t staged = staging_buffers<Op>(path, vec) * 2 * int64_t{rows} * nv * threads * 16;
  const int64_t cached = int64_t{column_values} * nv * vec * threads * int64_t{sizeof(float)};
  const int64_t sums = params ? int64_t{nv} * vec * threads * int64_t{sizeof(float)} : 0;
  return staged + cached > sums ? staged + cached : sums;
}

// kCache (resident paths of ops with column values, see ColumnCache): the values of the
// thread's columns are computed once, into shared memory, and read from there in each row.
// kR (the shared path only, see Op::kSharedRows): a row group takes kR rows at a time, staged
// together and reduced together (RowStates), so that each reduction's fixed costs (shuffles,
// barrier, cluster exchange) are paid once per kR rows.
// kCta: the CTA size the kernel is compiled for (kMaxThreads or kLargeCtaThreads, see
// with_cta; a launch may take fewer threads), and backward_min_ctas how many of them per SM.
template <class Op, typename T, int VEC, int NV, RowPath kPath, bool kParams, bool kCache,
          int kR = 1, int kCta = kMaxThreads>
__global__ void __launch_bounds__(kCta,
                                  backward_min_ctas(sizeof(T), kPath, kCta, Op::kReadsOnlyRows))
    backward_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                    const BackwardRows L, const Op op, const int tpr, const int cluster,
                    const Partials part) {
  using State = typename Op::State;
  using Rows = RowStates<State, kR>;
  constexpr bool kStream = kPath == RowPath::kStream;
  constexpr bool kShared = kPath == RowPath::kShared;
  static_assert(kR == 1 || kShared, "rows are taken kR at a time on the shared path only");
  static_assert(!kShared || VEC > 1, "the shared path stages 16-byte vectors");
  // Whether a row may span a cluster's CTAs here (the launcher gives the others cluster == 1).
  constexpr bool kClusters = spans_cluster(kPath);
  static_assert((kPath != RowPath::kCluster && !is_wide(kPath)) || Op::kClusterRegisters,
                "the op keeps its rows in shared memory");
  static_assert(kPath != RowPath::kStashed, "a forward path");
  // Register rows whose next row is prefetched into shared memory.
  constexpr bool kPrefetch = staging_buffers<Op>(kPath, VEC) == 1;
  // A resident row fits on chip, so its columns fit in an int; a streamed one may not.
  using Col = std::conditional_t<kStream, int64_t, int>;
  __shared__ Rows warp_totals[2][kCta / kWarpSize];
  __shared__ ClusterExchange<Rows> exchange;

  const bool cta_rows = kClusters || tpr > kWarpSize;
  const int group = tpr;
  const int t = static_cast<int>(threadIdx.x) % group;
  const int rows_per_cta = static_cast<int>(blockDim.x) / group;
  const int sub_row = static_cast<int>(threadIdx.x) / group;
  const int ctas = kClusters ? cluster : 1;
  const int rank = static_cast<int>(blockIdx.x) % ctas;
  const int64_t n = L.y.n;
  const int64_t ycs = VEC == 1 ? L.y.col_stride : 1;
  const int64_t gcs = VEC == 1 ? L.grad.col_stride : 1;
  const int64_t xcs = VEC == 1 ? L.grad_x.col_stride : 1;
  // Row groups of kR rows each: row i of group grp is row_of(grp, i).
  const int64_t row_groups = ceil_div(L.y.rows, int64_t{rows_per_cta} * kR);
  auto row_of = [&](int64_t grp, int i) { return (grp * kR + i) * rows_per_cta + sub_row; };
  const int64_t first_group = blockIdx.x / ctas;
  const int64_t group_stride = gridDim.x / ctas;
  // This thread's first vector of the row; vector k of step s is NV * s + k group-widths on.
  const int v0 = rank * NV * group + t;
  auto column = [&](Col s, int k) -> Col { return (v0 + (s * NV + k) * group) * VEC; };

  // This CTA's scratch rows (kParams): row first_group of the grad_weight and grad_bias
  // partials, which the row groups of a CTA fill together and the CTAs of a cluster each for
  // their own columns.
  float* part_w = kParams && part.w ? part.w + first_group * n : nullptr;
  float* part_b = kParams && part.b ? part.b + first_group * n : nullptr;
  float acc_w[NV][VEC], acc_b[NV][VEC];  // resident paths' partial sums
  // Dynamic shared memory: the streaming path's sums (one row per CTA there) when they are
  // not in the scratch rows, or the resident vector paths' staged vectors (see below).
  // Either way each thread reads and writes only its own, so no barrier is needed.
  extern __shared__ __align__(16) float dynamic_smem[];
  float* const smem_sums = dynamic_smem;
  float* sum_w = part_w;
  float* sum_b = part_b;
  if constexpr (kParams) {
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc_w[k][j] = acc_b[k][j] = 0.f;
    if constexpr (kStream) {
      if (part.smem_sums) {
        sum_w = part_w ? smem_sums : nullptr;
        sum_b = part_b ? smem_sums + (part_w ? n : 0) : nullptr;
      }
      for (int64_t c = static_cast<int64_t>(t) * VEC; c < n; c += int64_t{group} * VEC) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (sum_w) sum_w[c + j] = 0.f;
          if (sum_b) sum_b[c + j] = 0.f;
        }
      }
    }
  }

  // Staging: the thread's vectors of y and dy of a row are copied into shared memory (NV
  // slots each, laid out as framework.cuh's StagedVectors), so that loads stay in
  // flight through every reduction and write. kShared: they wait there from their read to
  // grad_x's write, in two buffers by row parity: a row's copies are started as soon as its
  // buffer is free, when the row before the previous one is written. kPrefetch: one buffer,
  // copied into registers at the top of the row; the next row's copies start once the
  // reduction has read them all. Each thread reads only the slots it filled itself: no
  // barrier.
  using Vec = Packed<T, VEC>;
  const int slot_stride = static_cast<int>(blockDim.x);
  auto slots = [&](unsigned buffer, int i, int array) {  // row i; array 0: y, 1: dy
    return reinterpret_cast<Vec*>(dynamic_smem) + threadIdx.x +
           ((buffer * kR + i) * 2 + array) * NV * slot_stride;
  };
  // Two cp.async commit groups per row. kShared commits empty ones where the group has no such row,
  // so that every row adds the same number of groups (see its cp_async_wait below);
  // kPrefetch waits for all groups and commits none for a missing row (with empty ones,
  // three of its kernels spilled on sm_75).
  auto stage_row = [&](int64_t grp, unsigned buffer) {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int64_t r = row_of(grp, i);
      const bool has_row = grp < row_groups && r < L.y.rows;
      if (kPrefetch && !has_row) return;
      const int end = has_row ? static_cast<int>(n) : 0;
      const StepCursor<int, 0> at{v0, group};
      stage_step<NV>(slots(buffer, i, 0), slot_stride, y + (has_row ? L.y.row.offset(r) : 0), at,
                     end);
      stage_step<NV>(slots(buffer, i, 1), slot_stride, dy + (has_row ? L.grad.row.offset(r) : 0),
                     at, end);
    }
  };
  if constexpr (kShared || kPrefetch) stage_row(first_group, 0);
  // The column cache, after the staging buffers; filled while the first row's copies are on
  // their way.
  using Values = ParamValues<Op::kColumnValues, VEC>;
  using Cache = ColumnCache<Op::kColumnValues, NV, VEC>;
  static_assert(!kCache || (!kStream && Op::template kCacheColumns<kPath>), "no column cache here");
  Vec* const staging_end = reinterpret_cast<Vec*>(dynamic_smem) +
                           staging_buffers<Op>(kPath, VEC) * 2 * kR * NV * slot_stride;
  const Cache cache{reinterpret_cast<typename Cache::Chunk*>(staging_end) + threadIdx.x,
                    slot_stride};
  if constexpr (kCache) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const Col c0 = column(0, k);
      if (c0 < n) cache.store(k, op.template columns<VEC>(c0));
    }
  }
  // The values of vector k (at column c0) of the current step.
  auto values = [&](int k, Col c0) -> Values {
    if constexpr (kCache)
      return cache.load(k);
    else
      return op.template columns<VEC>(c0);
  };
  if constexpr (kClusters) {
    if (cluster > 1) {
      cluster_exchange_init(exchange);
      cluster_sync();
    }
  }

  unsigned rows_done = 0;  // picks the staging buffer and cta_allreduce's
  for (int64_t grp = first_group; grp < row_groups; grp += group_stride) {
    // Row i of the group; inactive threads (past the last row) take part in the reductions
    // with nothing.
    int64_t r[kR];
    bool active[kR];
    Col end[kR];
    typename Op::Row rc[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      r[i] = row_of(grp, i);
      active[i] = r[i] < L.y.rows;
      end[i] = active[i] ? static_cast<Col>(n) : 0;
      rc[i] = op.row(active[i] ? r[i] : 0);
    }
    const T* yr = y + (active[0] ? L.y.row.offset(r[0]) : 0);
    const T* gr = dy + (active[0] ? L.grad.row.offset(r[0]) : 0);
    const Col steps = kStream ? static_cast<Col>(ceil_div(end[0], int64_t{NV} * group * VEC)) : 1;
    const unsigned buffer = kShared ? rows_done % 2 : 0;
    if constexpr (kShared) {
      // The other buffer's last reader, this thread's write of the previous rows, has its
      // values in registers (its stores depend on them): it can take the next rows. Then wait
      // for these rows' groups only.
      stage_row(grp + group_stride, buffer ^ 1u);
      cp_async_wait<2 * kR>();
    }

    // y's and dy's vectors of step s into registers (raw: 16-bit types stay packed), from
    // the prefetched copy or global memory: once per row (register path) or twice
    // (streamed). kShared reads its copy vector by vector instead, twice: all of a step at
    // once would hold y, dy, weight and bias of NV vectors in registers together.
    Vec yv[NV], gv[NV];
    auto load_step = [&](Col s) {
      if constexpr (kPrefetch) cp_async_wait<0>();
      if constexpr (!kShared) {
        const StagedVectors<VEC, T> staged_y{slots(0, 0, 0), slot_stride},
            staged_g{slots(0, 0, 1), slot_stride};
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const Col c0 = column(s, k);
          if (c0 < end[0]) {
            yv[k] = kPrefetch ? staged_y(k, c0) : load_vec<VEC>(yr, c0, ycs);
            gv[k] = kPrefetch ? staged_g(k, c0) : load_vec<VEC>(gr, c0, gcs);
          }
        }
      }
    };
    // Vector k of row i of the current step as floats.
    auto widen = [&](float (&yf)[VEC], float (&gf)[VEC], int i, int k, Col c0) {
      if constexpr (kShared) {
        to_floats(yf, StagedVectors<VEC, T>{slots(buffer, i, 0), slot_stride}(k, c0));
        to_floats(gf, StagedVectors<VEC, T>{slots(buffer, i, 1), slot_stride}(k, c0));
      } else {
        to_floats(yf, yv[k]);
        to_floats(gf, gv[k]);
      }
    };
    // Two partial sums per row, by vector parity: half as long a chain of dependent adds.
    // Each row asks values() for its vector's columns itself: read once ahead of the rows,
    // they stayed in registers across both, which cost the one-row kernels compiled from this
    // loop registers and speed; the two rows' reads are of the same shared-memory slots.
    Rows part[2] = {Rows::identity(), Rows::identity()};
    for (Col s = 0; s < steps; ++s) {
      load_step(s);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const Col c0 = column(s, k);
#pragma unroll
        for (int i = 0; i < kR; ++i) {
          if (c0 < end[i]) {
            float yf[VEC], gf[VEC];
            widen(yf, gf, i, k, c0);
            op.add(part[k % 2].s[i], yf, gf, values(k, c0));
          }
        }
      }
    }
    const Rows mine = Rows::combine(part[0], part[1]);
    // `mine` depends on every prefetched value, so they are all in registers: the slots can
    // take the next row.
    if constexpr (kPrefetch) stage_row(grp + group_stride, 0);
    // A whole warp's width as a constant: its steps then test and branch nothing.
    Rows total = cta_rows ? warp_allreduce(mine, kWarpSize) : warp_allreduce(mine, tpr);
    if (cta_rows)
      total = cta_allreduce<kCta / kWarpSize>(total, warp_totals[rows_done % 2],
                                              sub_row * (group / kWarpSize), group / kWarpSize);
    if constexpr (kClusters) {
      if (cluster > 1) total = cluster_allreduce(total, exchange, rows_done, rank, cluster);
    }
    ++rows_done;
    if (!active[0]) continue;  // no barrier follows in this iteration
    typename Op::Fin fin[kR];
    T* xr[kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      fin[i] = op.finish(total.s[i], rc[i]);
      xr[i] = dx && active[i] ? dx + L.grad_x.row.offset(r[i]) : nullptr;
    }

    for (Col s = 0; s < steps; ++s) {
      if constexpr (kStream) load_step(s);
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const Col c0 = column(s, k);
#pragma unroll
        for (int i = 0; i < kR; ++i) {
          if (c0 >= end[i]) continue;
          float yf[VEC], gf[VEC];
          widen(yf, gf, i, k, c0);
          float out[VEC];
          if constexpr (kParams && kStream) {
            float w[VEC] = {}, b[VEC] = {};
            op.template grad<true>(out, w, b, yf, gf, values(k, c0), c0, rc[i], fin[i]);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              if (sum_w) sum_w[c0 + j] += w[j];
              if (sum_b) sum_b[c0 + j] += b[j];
            }
          } else {
            op.template grad<kParams>(out, acc_w[k], acc_b[k], yf, gf, values(k, c0), c0, rc[i],
                                      fin[i]);
          }
          if (xr[i]) store_vec<VEC>(xr[i], c0, xcs, out);
        }
      }
    }
  }

  if constexpr (kParams && kStream) {
    if (part.smem_sums) {
      for (int64_t c = static_cast<int64_t>(t) * VEC; c < n; c += int64_t{group} * VEC) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (part_w) part_w[c + j] = sum_w[c + j];
          if (part_b) part_b[c + j] = sum_b[c + j];
        }
      }
    }
  }
  if constexpr (kParams && !kStream) {
    // Every column of the row is owned by one thread of each row group; groups that saw no
    // row add zeros. With one row group per CTA (or cluster) its threads write their sums
    // straight into the scratch row. Several (rows of a few lanes or of whole warps) add
    // theirs in shared memory first, [sub_row][column], in sub-row order: a scratch row per
    // group would leave sum_partials_kernel many times the partials to read. The staging
    // slots are free by then: every thread has waited for its last copies, and the first
    // barrier orders all reads of them before the writes.
    auto write_sums = [&](float (&acc)[NV][VEC], float* scratch_row) {
      float* const rows = dynamic_smem;
      const bool shared = rows_per_cta > 1;
      if (shared) {
        cp_async_wait<0>();
        __syncthreads();
      }
      float* const dst = shared ? rows + sub_row * n : scratch_row;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const Col c0 = column(0, k);
        if (c0 >= n) continue;
#pragma unroll
        for (int j = 0; j < VEC; ++j) dst[c0 + j] = acc[k][j];
      }
      if (!shared) return;
      __syncthreads();
      for (int c = static_cast<int>(threadIdx.x); c < n; c += static_cast<int>(blockDim.x)) {
        float sum = rows[c];
        for (int g = 1; g < rows_per_cta; ++g) sum += rows[g * n + c];
        scratch_row[c] = sum;
      }
    };
    if (part_w) write_sums(acc_w, part_w);
    if (part_b) write_sums(acc_b, part_b);
  }
  // No CTA leaves while another may still send it a total.
  if constexpr (kClusters) {
    if (cluster > 1) cluster_sync();
  }
}

}  // namespace mti
