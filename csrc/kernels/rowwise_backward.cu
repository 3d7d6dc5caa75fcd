// Backward kernels of the row-wise ops, from the forward's output y: softmax / log_softmax
// and LayerNorm / RMSNorm (with their weight and bias gradients).
//
// One kernel serves both ops through a functor (SoftmaxBackwardOp, NormBackwardOp below). A
// row belongs to a group of `tpr` threads: tpr <= 32 lanes, a run of whole warps (both with
// as many rows per CTA as fit in kMaxThreads, but softmax's 16-bit rows of more than a warp:
// one_row_per_cta), a CTA of up to kLargeCtaThreads (see there), or
// on sm_90+ a cluster of `cluster` CTAs of kMaxThreads (or kLargeCtaThreads) that reduce over
// distributed shared memory (kernels/reduce.cuh). Thread t of the group owns the row's vectors
// t, t + tpr, t + 2 tpr, ... (so a warp reads 32 neighbouring vectors at a time), NV of them
// per step; in a cluster, CTA `rank` owns the rank-th run of tpr * NV vectors. The grid
// strides over groups of rows (clusters), or has a CTA per group where grid_waves() says so.
//  - Path::kRegisters: rows that a CTA holds in registers, one step, read once. Vector rows
//    (16-byte accesses, see below) are prefetched: the thread's vectors of its next row are
//    copied into shared memory (cp.async) while the current row is reduced and written
//    (but softmax's, which take a CTA per row group and so have no next row: see
//    staging_buffers).
//  - Path::kWideRegisters: the same for softmax's rows that a CTA holds only with more
//    elements per thread (16-bit rows, SoftmaxBackwardOp::kWideElems).
//  - Path::kRegisterCluster: the same for softmax's longer vector rows (but 16-bit
//    log_softmax's), held by the registers of a cluster of CTAs on sm_90+;
//    Path::kWideRegisterCluster with kWideElems per thread, for rows that no cluster holds
//    otherwise.
//  - Path::kShared: other longer vector rows, each thread's vectors of y and dy copied
//    into shared memory (cp.async), reduced from there vector by vector and grad_x computed
//    from the same copy, so y and dy are read from DRAM once; on sm_90+ a cluster of CTAs
//    holds a row. Two buffers: the next row's vectors are on their way while the current row
//    is reduced and written. Slower than registers where those hold the row (measured 5-15%
//    on an H100 at 0794bd0: a shared memory read per vector and pass, and half the rows in
//    flight). 16-bit norm rows on the largest clusters take two rows at a time
//    (NormBackwardOp::kSharedRows).
//  - Path::kStream: rows longer than a cluster holds; a first pass over the steps reduces, a
//    second reads y and grad again (from L2 where the row is still there) and writes.
// With every col_stride 1, 16-byte aligned rows (and mask rows, weight, bias) and n a multiple
// of VEC, accesses move 16 bytes (VEC elements); otherwise the same kernel runs with VEC = 1.
//
// grad_weight / grad_bias (LayerNorm, RMSNorm): each CTA (cluster) sums grad * t
// (t = y - bias = x_hat * weight) and grad over the rows it handles, per column, into its own
// fp32 row of a scratch [P, n] (P = CTAs, or clusters, the grid holds at once): in registers
// on the resident paths (a thread owns the same columns in every row; the row groups of a CTA
// add theirs at the end; the CTAs of a cluster each fill their own columns of the cluster's
// row), in shared memory on the streaming path, or in a column pass of its own
// (column_sums_kernel) where those sums fit in no CTA's shared memory. A second kernel adds
// the P partial rows of each column in a fixed order, so the result does not depend on
// scheduling, and divides grad_weight's by the weight. The scratch is bounded by
// max(kScratchFloor, bytes of grad_x / 4) (grid capped accordingly).
#include "kernels/rowwise_backward.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "kernels/reduce.cuh"
#include "kernels/rowwise.cuh"
#include "kernels/softmax_rows.cuh"

namespace mti {
namespace {

// The shared path's clusters past which Op::kSharedRows apply.
constexpr int kGroupedRowsCluster = 8;

// The backward kernel's paths (see the top of the file).
// kRegisterCluster is kRegisters compiled with the cluster reduction, which costs the
// single-CTA kernels 4-10 registers (sm_90a).
enum class Path {
  kRegisters,
  kWideRegisters,
  kRegisterCluster,
  kWideRegisterCluster,
  kShared,
  kStream
};

// Which rows past a CTA's registers a cluster's registers hold (Path::kRegisterCluster, and
// Path::kWideRegisterCluster where the op has it), the others being staged in shared memory
// (Path::kShared): none, only those that take clusters of large CTAs (see pick_shape), or
// all. See SoftmaxBackwardOp::cluster_registers.
enum class ClusterRegisters { kNone, kLargeCtas, kAll };

// Elements (Path::kRegisters) or vectors (Path::kShared) per thread. Registers: softmax's y
// and grad take 32 registers each in fp32 (16-bit types take 64 elements there on the wide
// paths, see SoftmaxBackwardOp::kWideElems); norms read weight and bias along, and with
// grad_weight / grad_bias keep 2 fp32 sums per element a thread owns: kParamElems. Shared
// memory bounds Path::kShared's rows, not registers: kStagedVectors of y and dy per thread and
// buffer, 64 KiB per CTA of kMaxThreads with both buffers, so that two CTAs fit on an SM
// (H100: 228 KiB; their shares of a row are then 4096 fp32 / 8192 16-bit elements);
// registers hold a vector at a time there, but for the parameter gradient sums (kParamElems
// again; norms take as many without them too, which leaves room for their column cache).
// Scalar rows (VEC 1) sit in registers, kScalarNV elements. Streaming: kStreamElems per
// step, fewer than registers would take, to avoid spills.
constexpr int kSoftmaxElems = 32;
constexpr int kParamElems = 16;
constexpr int kStagedVectors = 4;
constexpr int kStreamElems = 16;

// Vectors (of vec elements) per thread and step of `path`.
template <class Op>
constexpr int path_nv(Path path, int vec, bool params) {
  if (vec == 1) return kScalarNV;
  switch (path) {
    case Path::kRegisters:
    case Path::kRegisterCluster:
      return (params ? kParamElems : Op::kResidentElems) / vec;
    case Path::kWideRegisters:
    case Path::kWideRegisterCluster:
      if constexpr (Op::kClusterRegisters) return Op::kWideElems / vec;
      break;
    case Path::kShared:
      return (params || Op::template kCacheColumns<Path::kShared>) &&
                     kParamElems / vec < kStagedVectors
                 ? kParamElems / vec
                 : kStagedVectors;
    case Path::kStream:
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

constexpr int kRowsThreads = 128;   // CTA size when several rows share a CTA
// CTA size of the ops whose register rows take a CTA of more than kMaxThreads threads before a
// cluster (Op::kLargeCtas; one CTA per SM at up to 128 registers a thread), of their
// register clusters (Op::kLargeClusterMin), and of every op's shared-path clusters that CTAs
// of kMaxThreads would be too many for: a row then needs half the CTAs, and rows that CTAs of
// kMaxThreads would share by a cluster reduction need none. H100, 2^26 elements, backward,
// ratio to clone-equivalent bandwidth, CTAs of 256 -> 512 (one build, switched at run time,
// three sweeps each; stop 47):
// - fp32 softmax_ / log_softmax_ at N = 16384 (one CTA instead of a cluster of 2): 0.88 ->
//   0.987 / 0.876 -> 0.925; at 32768 (clusters of 2 instead of 4) 0.86 -> 0.893 / 0.845 ->
//   0.864; 131072 0.78 -> 0.84 / 0.745 -> 0.80; 262144 (clusters of 16, streamed before) 0.585
//   -> 0.72 / 0.58 -> 0.67.
// - 16-bit softmax_ / log_softmax_ at 32768 (one CTA of 64 per thread): 0.84 -> 0.90-0.91 /
//   0.81 -> 0.91-0.92; softmax_ at 131072 (clusters of 8 instead of 16) 0.79 -> 0.82.
// - 16-bit norms at 8192 (one CTA instead of a shared-path cluster of 2): layer_norm_ 0.78 ->
//   0.79-0.80, rms_norm_ 0.82 -> 0.85-0.87.
// - Shared-path rows that no cluster of CTAs of kMaxThreads holds, streamed before (stop 48,
//   two sweeps each): the norms at N = 131072 (clusters of 16), layer_norm_ 0.34 / 0.31
//   (fp32 / 16-bit) -> 0.78-0.79 / 0.64-0.67, rms_norm_ 0.36 / 0.32-0.33 -> 0.80 / 0.69-0.72;
//   16-bit log_softmax_ at 262144 0.55 (the committed sweep) -> 0.70 (one sweep). In place of
//   the shared path's clusters of CTAs of kMaxThreads they lost: the 16-bit norms at
//   16384-65536 0.72-0.81 -> 0.67-0.79, 16-bit log_softmax_ at 65536-131072 0.76-0.80 ->
//   0.69-0.72 (fp32 norms within -2% to +1%).
// Not taken (NormBackwardOp, SoftmaxBackwardOp::kLargeClusterMin): fp32 norms at 8192 lost
// (0.883 -> 0.826 / 0.884 -> 0.854), as did 16-bit softmax_ on clusters of 4 at 65536 (0.833
// -> 0.82) and of 16 at 262144 in place of the wide path (0.765 -> 0.752). The other widths
// (CTAs of kMaxThreads either way) read the same. Softmax's large CTAs take a CTA per row
// (grid_waves, as its rows of kMaxThreads): striding over rows, the next one prefetched, lost
// 1-4% (fp32 16384 0.987 -> 0.950, 16-bit 32768 0.90 -> 0.89). (The forward, which
// prefetches nothing and overlaps its CTAs' phases instead, lost with them: see kCtaRegs in
// kernels/rowwise.cuh.)
constexpr int kLargeCtaThreads = 512;
constexpr int kThreadsPerSm = 2048;
constexpr int64_t kScratchFloor = int64_t{4} << 20;  // bytes of scratch always allowed

// What softmax's backward sums its rows in. fp32 rows sum in fp64: in fp32, the rounding of
// a sum near a peaked row's largest term reaches grad_x undiminished wherever grad and the
// sum's mean cancel, which measured up to 4x PyTorch's error (H100, fp32, n = 1000).
// Products of two fp32 values are exact in fp64. 16-bit rows keep fp32, far finer than their
// outputs.
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
  static constexpr int kResidentElems = kSoftmaxElems;
  // Rows past a CTA's registers: held by a cluster's registers (Path::kRegisterCluster)
  // where cluster_registers() says so, else staged in shared memory (Path::kShared). H100,
  // 2^26 elements, ratio to clone-equivalent bandwidth at N = 16384-65536, shared ->
  // registers: 16-bit softmax_ 0.80-0.85 -> 0.83-0.87, fp32 softmax_ and log_softmax_
  // 0.80-0.87 -> 0.84-0.89, and fp32 rows of 131072, which no cluster's shared memory holds,
  // 0.59 -> 0.78 instead of streamed. 16-bit log_softmax_ (which alone computes exp(y), in
  // both passes) lost 1-7% on registers at 32768-131072 while its exps took five
  // instructions; since with_exp's two (no mask tensor), registers against the shared path
  // (two builds, two sweeps each in turns, stop 53, bf16 and fp16 alike): N = 65536 (clusters
  // of 8 CTAs of kMaxThreads) 0.84 -> 0.83, 131072 (clusters of 8 large CTAs) 0.79-0.80 ->
  // 0.84, 262144 (wide clusters of 16) 0.80 -> 0.72. So those take registers only on large
  // CTAs; with a mask tensor, none. (The norms lost more: see NormBackwardOp.)
  static constexpr bool kClusterRegisters = true;
  ClusterRegisters cluster_registers() const {
    if (sizeof(T) == 4 || !log) return ClusterRegisters::kAll;
    return kLoopsApart ? ClusterRegisters::kLargeCtas : ClusterRegisters::kNone;
  }
  // Elements per thread on Path::kWideRegisters (rows that one CTA holds only with more than
  // kResidentElems, for every softmax, cluster_registers() or not) and
  // Path::kWideRegisterCluster (rows that no cluster holds with kResidentElems): a 16-bit
  // thread holds 64 there, packed, as 32 registers each of y and dy, so that a CTA holds
  // 16384 and a cluster 262144. H100, 2^26 elements, bf16 backward, ratio to clone's
  // bandwidth (bench_rowwise, against the sweeps before): softmax_ at N = 16384 0.867 ->
  // 0.902 (fp16 0.869 -> 0.911; with the cluster kernel launched as one CTA, 0.859),
  // log_softmax_ at 16384 (from the shared path) 0.842 -> 0.895, softmax_ at 262144
  // (streamed before) 0.56 -> 0.76. Clusters of 64 per thread at 32768-131072 read -4% to
  // +3% against those of 32 (sweeps on three machines), and an A/B in one build could not
  // tell them apart (the same arm read 2-4% apart from turn to turn): not taken. 16-bit
  // log_softmax_ on clusters of 64 per thread lost 5-7% against the shared path at
  // 32768-131072 (the same A/B, 1-1.5% between identical arms). Rows that 32 per thread hold
  // lost with 64 (softmax_ 0.925 -> 0.870 at 2048, 0.907 -> 0.899 at 8192; log_softmax_
  // 0.918 -> 0.889 at 8192, in an A/B against y + dy into a third tensor), and with 16 (64-76
  // registers, three or four CTAs per SM; main and it built side by side, two sweeps each,
  // stop 48): 16-bit softmax_ 0.94-0.96 -> 0.91-0.92 at N = 1024-4096 and 0.94 -> 0.79 at
  // 8192 (then on the wide path), log_softmax_ 0.93 -> 0.90 at 2048-4096, though 0.90 ->
  // 0.91-0.92 at 256-512. So kResidentElems stays 32.
  static constexpr int kWideElems = sizeof(T) == 2 ? 2 * kSoftmaxElems : kSoftmaxElems;
  static constexpr int kColumnValues = 0;
  template <Path>
  static constexpr bool kCacheColumns = false;
  static constexpr int kSharedRows = 1;
  // See kLargeCtaThreads.
  static constexpr bool kLargeCtas = true;
  static constexpr int kLargeClusterMin = sizeof(T) == 4 ? 2 : 9;

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
  // apart from log_softmax's: with one loop for both inside with_exp, 16-bit softmax_ lost
  // 4-5% at N = 16384-65536. Elsewhere one loop serves both, as before with_exp: apart, fp16's
  // masked kernels of rows that no cluster holds (Path::kWideRegisterCluster) spilled 4 bytes
  // on sm_90a. H100, 2^26 elements, backward, ratio to clone-equivalent bandwidth, two builds,
  // two sweeps each in turns, __expf in one loop for both -> with_exp in loops apart: 16-bit
  // log_softmax_ 0.945-0.972 -> 0.977-0.991 at N = 1024-8192, 0.91 -> 0.92-0.94 at
  // 16384-32768, 0.80 -> 0.84 at 65536, 0.76 -> 0.79-0.80 at 131072; 16-bit softmax_
  // 0.94-0.95 -> 0.97 at 16384, 0.83 -> 0.85 at 65536 (causal at 65536 0.827 -> 0.823).
  static constexpr bool kLoopsApart = sizeof(T) == 2 && kMask == MaskKind::kNone;

  // Calls f with log_softmax's exp for a vector y: with_exp_for, from the vector's smallest y
  // (as the forward's SoftmaxOp::local does per chunk). Not with a mask tensor: skipping its
  // -inf costs an FMA per element, and the fp16 kernels of rows that no cluster holds
  // otherwise spilled 12-16 bytes. f is called once, so that each exp is computed where it is
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

template <typename T>
struct NormBackwardOp {
  // fp32 sums: in fp64 the fp32 resident kernel, which holds y, dy and two column sums per
  // element in registers, spills.
  using State = Sum2<float>;  // sum(g_hat), sum(g_hat * x_hat) = sum(grad * t)
  static constexpr bool kHasParams = true;
  static constexpr int kResidentElems = kParamElems;
  // Rows past a CTA's registers take Path::kShared. Held by a cluster's registers instead
  // (as softmax's are), fp32 rows measured 9-19% slower at N = 8192-65536 (H100; fp32 caches
  // no columns on that path, see kCacheColumns, and that kernel then spilled 8 bytes) and
  // 16-bit ones within 2% of the shared path.
  static constexpr bool kClusterRegisters = false;
  // Per column, as floats: the weight and the bias (1 and 0 where absent) and for 16-bit
  // types the weight's approximate reciprocal (0 where the weight is 0; fp32 divides, see
  // grad()); see columns(). Cached (see backward_kernel's kCache) for 16-bit types, and for
  // fp32 on the shared path only: its register kernel with parameter gradients has no
  // register to spare (with the cache it spilled 4 bytes on sm_90). On the shared path fp32
  // gained most (H100, N = 65536, both parameter gradients: LayerNorm 440 -> 325 us, RMSNorm
  // 392 -> 324 us; N = 16384: 360 -> 305, 354 -> 303), its weight and bias loads having hit
  // L1 only half the time.
  static constexpr int kColumnValues = sizeof(T) == 4 ? 2 : 3;
  template <Path kPath>
  static constexpr bool kCacheColumns = sizeof(T) == 2 || kPath == Path::kShared;
  // Rows per step on clusters of more than kGroupedRowsCluster CTAs on the shared path (see
  // backward_kernel's kR), where that costs no occupancy: 16-bit rows take two, which share
  // one pass of each reduction, the cluster's included, whose cost grows with the cluster.
  // H100, 2^26 elements, both parameter gradients, ratio to clone-equivalent bandwidth, main
  // and this built side by side, three sweeps each in turns: N = 65536 (clusters of 16),
  // LayerNorm bf16 / fp16 0.681-0.687 / 0.680-0.690 -> 0.721-0.727 / 0.721-0.724, RMSNorm
  // 0.715-0.724 / 0.724-0.731 -> 0.765-0.769 / 0.761-0.762. On every cluster (an earlier
  // build) rows of 16384-32768 (clusters of 4-8) lost 1-2% and 8192 (2) gained nothing.
  // fp32 rows stage twice the bytes per element, and two of them leave one CTA per SM.
  static constexpr int kSharedRows = sizeof(T) == 2 ? 2 : 1;
  // See kLargeCtaThreads; the norms have no register clusters.
  static constexpr bool kLargeCtas = sizeof(T) == 2;
  static constexpr int kLargeClusterMin = 0;
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
  // kernels, which issue-bound them (H100, bf16 LayerNorm, N = 8192).
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
  // FMAs on the row's means times rstd (H100, bf16 LayerNorm with both parameter gradients:
  // 0.63x -> 0.73x of clone-equivalent bandwidth at N = 1024). fp32 keeps the division and
  // the textbook form: the fused one makes its register kernel spill.
  template <bool kParams, int VEC>
  __device__ __forceinline__ void grad(float (&out)[VEC], float (&acc_w)[VEC],
                                       float (&acc_b)[VEC], const float (&y)[VEC],
                                       const float (&g)[VEC],
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

// Where the scratch rows of the parameter gradients start: [want_w ? P : 0 rows of grad_weight
// partials][want_b ? P : 0 rows of grad_bias partials], each row n floats.
struct Partials {
  float* w;  // nullptr: grad_weight not wanted
  float* b;  // nullptr: grad_bias not wanted
  bool smem_sums = false;  // streaming path: sum in dynamic shared memory, [w?][b?] x n floats
};

// Whether the rows of `path` take a CTA per row group (grid_waves): softmax's register rows.
template <class Op>
__host__ __device__ constexpr bool always_cta_per_group(Path path) {
  return path == Path::kRegisters && !Op::kHasParams;
}

// Whether vector register rows of more than a warp take a CTA of their own (tpr threads)
// rather than sharing CTAs of up to kMaxThreads: softmax's 16-bit rows. Rows that share a
// CTA reduce in lockstep, each waiting at the CTA's barriers for the slowest; a CTA per row
// lets each row's loads, reduction and stores run at their own pace, and on 768 threads per
// SM (backward_min_ctas) more rows are in flight. H100, 2^26 elements, backward, ratio to
// clone-equivalent bandwidth at N = 2048-8192, two builds, two sweeps each in turns, rows
// sharing CTAs of 256 and striding over them -> a CTA per row: softmax_
// 0.920-0.934 -> 0.976-0.985, log_softmax_ 0.917-0.925 -> 0.947-0.971, softmax_ with a bool
// mask 0.937-1.077 -> 0.987-1.141 (bf16 and fp16 alike). fp32 rows (0.99 sharing) keep theirs.
template <class Op, typename T>
constexpr bool one_row_per_cta() {
  return !Op::kHasParams && sizeof(T) == 2;
}

// Staging buffers of y's and dy's vectors that backward_kernel's `path` keeps in shared
// memory (see there): two on the shared path, one for the register paths' prefetch of vector
// rows, none for scalar or streamed rows, nor where always_cta_per_group: no CTA has a next
// row to prefetch there, and staging the row it has only delays it. H100, 2^26 elements,
// backward, ratio to clone-equivalent bandwidth at N = 1024-8192, two sweeps each against the
// prefetching kernel: fp32 softmax_ 0.990-0.993 -> 0.993-0.997, log_softmax_ 0.980-0.987 ->
// 0.987-0.993. (16-bit rows of up to a warp gained 1-2% without staging; for the rows of a
// CTA see one_row_per_cta.)
template <class Op>
__host__ __device__ constexpr int staging_buffers(Path path, int vec) {
  if (vec == 1 || path == Path::kStream) return 0;
  if (always_cta_per_group<Op>(path)) return 0;
  return path == Path::kShared ? 2 : 1;
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

// CTAs of `cta` threads that backward_kernel is compiled to fit on an SM at once; the
// register cap follows (128 per thread for 2 * kMaxThreads threads, 80 for 768). Softmax's
// 16-bit register rows run on CTAs of fewer threads (kRowsThreads for rows of up to a warp,
// else one_row_per_cta), so an SM takes as many threads as their registers allow. Without a
// mask their kernel is compiled for 768: 80 registers on sm_90a, where the kernel for 512 had
// 83 (with a mask, fp16 spills 8-16 bytes at 80; those kernels have 88-89 registers, about
// 640 threads per SM). H100, 2^26 elements, backward, ratio to clone-equivalent bandwidth
// at N = 256-1024, two sweeps each against 512 threads per SM and the rows staged: softmax_
// 0.955-0.969 -> 0.975-0.986, log_softmax_ 0.892-0.906 -> 0.961-0.974; bf16 softmax_ with a
// bool mask or causal (88 registers, 640 threads) 0.957-0.962 -> 0.975-0.983. The rows of a
// CTA lost at 768 threads while they shared CTAs of kMaxThreads (softmax_ 0.94 -> 0.92,
// log_softmax_ 0.93 -> 0.90 at N = 2048-8192), and gained one to a CTA (see
// one_row_per_cta).
template <class Op, typename T>
__host__ __device__ constexpr int backward_min_ctas(Path path, int cta) {
  if (cta > kMaxThreads) return 1;
  if (std::is_same_v<Op, SoftmaxBackwardOp<T, MaskKind::kNone>> && sizeof(T) == 2 &&
      path == Path::kRegisters)
    return 3;
  return 2;
}

// Dynamic shared memory of a resident launch: its staging buffers (of `rows` rows each, see
// backward_kernel's kR) and its column cache (`column_values` arrays, 0 without one), and
// with parameter gradients at least the CTA's per-thread column sums (the rows of a CTA add
// theirs there at the end, see backward_kernel; only the scalar path, which stages nothing,
// needs more).
template <class Op>
constexpr int64_t resident_backward_smem(Path path, int vec, int nv, int threads, bool params,
                                         int column_values, int rows) {
  const int64_t staged =
      staging_buffers<Op>(path, vec) * 2 * int64_t{rows} * nv * threads * 16;
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
template <class Op, typename T, int VEC, int NV, Path kPath, bool kParams, bool kCache,
          int kR = 1, int kCta = kMaxThreads>
__global__ void __launch_bounds__(kCta, backward_min_ctas<Op, T>(kPath, kCta))
    backward_kernel(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                    const BackwardRows L, const Op op, const int tpr, const int cluster,
                    const Partials part) {
  using State = typename Op::State;
  using Rows = RowStates<State, kR>;
  constexpr bool kStream = kPath == Path::kStream;
  constexpr bool kShared = kPath == Path::kShared;
  static_assert(kR == 1 || kShared, "rows are taken kR at a time on the shared path only");
  static_assert(!kShared || VEC > 1, "the shared path stages 16-byte vectors");
  // Whether a row may span a cluster's CTAs here (the launcher gives the others cluster == 1).
  constexpr bool kClusters =
      kShared || kPath == Path::kRegisterCluster || kPath == Path::kWideRegisterCluster;
  static_assert((kPath != Path::kRegisterCluster && kPath != Path::kWideRegisters &&
                 kPath != Path::kWideRegisterCluster) ||
                    Op::kClusterRegisters,
                "the op keeps its rows in shared memory");
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
  // slots each, laid out as kernels/rowwise.cuh's StagedVectors), so that loads stay in
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
  // three of its kernels spilled 4 bytes on sm_75).
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
  static_assert(!kCache || (!kStream && Op::template kCacheColumns<kPath>),
                "no column cache here");
  Vec* const staging_end =
      reinterpret_cast<Vec*>(dynamic_smem) +
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
    // loop registers and speed (stop 46, rowwise_cluster_profile.md); the two rows' reads are
    // of the same shared-memory slots.
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
    // group measured 8.6 MB of partials at N = 256 (bf16 LayerNorm on an H100), which
    // sum_partials_kernel then took 34 us to read. The staging slots are free by then: every
    // thread has waited for its last copies, and the first barrier orders all reads of them
    // before the writes.
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

// out[c] <- sum over p of partials[p * n + c], p in order, for the array blockIdx.y (0:
// grad_weight when wanted, else grad_bias); grad_weight's partials sum grad * t, so its sums
// are divided by weight[c] (0 where that is 0, as x_hat is there). The CTA's threads form
// `slices` (a power of two <= kMaxThreads) slices of kMaxThreads / slices lanes; lane i owns
// VEC columns, and slice s sums the partial rows s, s + slices, ... of them (kSumChains rows
// in flight per thread); then the CTA adds the slices' sums of each column in order. The
// launcher takes as many slices as there are partial rows, up to kSumMaxSlices: a few
// hundred rows (N <= 4096) need many loads in flight per column (measured on an H100 with 8
// slices, a load at a time and a scalar per thread: 34 us for the 8.6 MB at N = 256), a
// few dozen (clusters, at N >= 8192) over many columns need few CTAs that each cover more.
constexpr int kSumMaxSlices = 32;
constexpr int kSumChains = 4;

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    sum_partials_kernel(const Partials part, int64_t partial_rows, int64_t n, int slices,
                        const T* weight, T* grad_weight, T* grad_bias) {
  __shared__ float sums[kMaxThreads * VEC];  // [slice][column of the CTA]
  const bool weight_array = blockIdx.y == 0 && grad_weight != nullptr;
  const float* src = weight_array ? part.w : part.b;
  T* out = weight_array ? grad_weight : grad_bias;
  const int lanes = kMaxThreads / slices;
  const int cols = lanes * VEC;
  const int lane = static_cast<int>(threadIdx.x) % lanes;
  const int slice = static_cast<int>(threadIdx.x) / lanes;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * cols + lane * VEC;
  float acc[kSumChains][VEC] = {};
  if (c0 < n) {
    auto add_row = [&](float (&a)[VEC], int64_t p) {
      const Packed<float, VEC> v = load_vec<VEC>(src + p * n, c0, 1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) a[j] += v.v[j];
    };
    int64_t p = slice;
    for (; p + (kSumChains - 1) * slices < partial_rows; p += kSumChains * slices) {
#pragma unroll
      for (int i = 0; i < kSumChains; ++i) add_row(acc[i], p + i * slices);
    }
    for (; p < partial_rows; p += slices) add_row(acc[0], p);
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float s = acc[0][j];
#pragma unroll
    for (int i = 1; i < kSumChains; ++i) s += acc[i][j];
    sums[slice * cols + lane * VEC + j] = s;
  }
  __syncthreads();
  // Up to VEC columns per thread (one slice: every thread's columns).
  for (int col = static_cast<int>(threadIdx.x); col < cols; col += kMaxThreads) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * cols + col;
    if (c >= n) break;
    float total = sums[col];
    for (int i = 1; i < slices; ++i) total += sums[i * cols + col];
    if (weight_array) {
      const float w = to_float(weight[c]);
      total = w == 0.f ? 0.f : total / w;
    }
    out[c] = from_float<T>(total);
  }
}

// Slices of the CTA's warps that share column_sums_kernel's rows.
constexpr int kSlices = kMaxThreads / kWarpSize;

// Streamed rows whose parameter gradient sums fit in no CTA's shared memory: backward_kernel
// computes grad_x only, and this kernel reads y and dy once more to sum grad * x_hat and grad
// by columns. CTA (x, s) owns the kWarpSize * VEC columns of tile x and the rows s * kSlices +
// w + i * gridDim.y * kSlices for its warps w; it adds its warps' sums in order into scratch
// row s (sum_partials_kernel then adds the scratch rows).
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    column_sums_kernel(const T* __restrict__ y, const T* __restrict__ dy, const BackwardRows L,
                       const NormBackwardOp<T> op, const Partials part) {
  __shared__ float sums_w[kSlices][kWarpSize * VEC], sums_b[kSlices][kWarpSize * VEC];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int slice = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t n = L.y.n;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kWarpSize + lane) * VEC;
  const int64_t ycs = VEC == 1 ? L.y.col_stride : 1;
  const int64_t gcs = VEC == 1 ? L.grad.col_stride : 1;
  float acc_w[VEC] = {}, acc_b[VEC] = {};
  if (c0 < n) {
    const int64_t stride = int64_t{gridDim.y} * kSlices;
    for (int64_t r = int64_t{blockIdx.y} * kSlices + slice; r < L.y.rows; r += stride) {
      float yf[VEC], gf[VEC], t[VEC], gh[VEC];
      to_floats(yf, load_vec<VEC>(y + L.y.row.offset(r), c0, ycs));
      to_floats(gf, load_vec<VEC>(dy + L.grad.row.offset(r), c0, gcs));
      op.terms(t, gh, yf, gf, op.template columns<VEC>(c0));
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        acc_w[j] += gf[j] * t[j];
        acc_b[j] += gf[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sums_w[slice][lane * VEC + j] = acc_w[j];
    sums_b[slice][lane * VEC + j] = acc_b[j];
  }
  __syncthreads();
  if (slice != 0 || c0 >= n) return;
  const int64_t out = int64_t{blockIdx.y} * n + c0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    float w = sums_w[0][lane * VEC + j], b = sums_b[0][lane * VEC + j];
#pragma unroll
    for (int i = 1; i < kSlices; ++i) {
      w += sums_w[i][lane * VEC + j];
      b += sums_b[i][lane * VEC + j];
    }
    if (part.w) part.w[out + j] = w;
    if (part.b) part.b[out + j] = b;
  }
}

// ---------------------------------------------------------------------------- host side

// The path, threads per row group and CTA, and CTAs per row, for rows of `vecs` vectors:
// registers (reg_nv vectors per thread) where a CTA's hold the row, or wide_nv (0: the op
// has no wide paths) where only those do; else (as cluster_registers says) the registers of
// as few CTAs as hold it with reg_nv each, or wide_nv where reg_nv needs more than
// max_cluster, or (otherwise) their shared memory (shared_nv per thread), up to
// `max_cluster` CTAs (0: none), else streamed. large_threads > 0 (vector rows) is the size of
// the larger CTAs some rows take: with large_registers (Op::kLargeCtas), rows that one such
// CTA holds in registers (wide_nv where the op has it) take one before any cluster, and
// register clusters take such CTAs where those of kMaxThreads would number at least
// large_cluster_min (Op::kLargeClusterMin) and hold the row without the wide path;
// shared-path rows take them where more CTAs of kMaxThreads than max_cluster (> 1) would be
// needed.
struct Shape {
  int threads = 0;  // CTA size
  int tpr = 0;      // threads per row (a divisor of threads; on a cluster, the CTA's share)
  int cluster = 1;  // CTAs per row: > 1 only on sm_90+
  Path path = Path::kRegisters;
};

Shape pick_shape(int64_t vecs, int reg_nv, int wide_nv, int shared_nv, int max_cluster,
                 bool row_per_cta, ClusterRegisters cluster_registers, int large_threads,
                 bool large_registers, int large_cluster_min) {
  Shape s;
  if (vecs <= int64_t{kWarpSize} * reg_nv) {
    // The fewest lanes that hold the row: more bytes in flight per thread, fewer shuffles.
    s.tpr = static_cast<int>(next_pow2(ceil_div(vecs, reg_nv)));
    s.threads = kRowsThreads;
    return s;
  }
  if (vecs <= int64_t{kMaxThreads} * reg_nv) {
    // As many rows per CTA as fit in kMaxThreads (but `row_per_cta`, see one_row_per_cta):
    // with parameter gradients each CTA writes one scratch row, so fewer, larger CTAs mean
    // fewer partial sums to write and add.
    s.tpr = static_cast<int>(round_up(ceil_div(vecs, reg_nv), kWarpSize));
    s.threads = row_per_cta ? s.tpr : s.tpr * (kMaxThreads / s.tpr);
    return s;
  }
  // As few full CTAs as hold the row (any count: a power of two would leave up to half of
  // them idle), or streamed.
  s.threads = s.tpr = kMaxThreads;
  const bool wide = wide_nv > 0 && max_cluster > 0;
  if (wide && vecs <= int64_t{kMaxThreads} * wide_nv) {
    s.path = Path::kWideRegisters;
    return s;
  }
  if (large_registers && large_threads > 0) {
    const int nv = wide ? wide_nv : reg_nv;
    if (vecs <= int64_t{large_threads} * nv) {
      s.threads = s.tpr = static_cast<int>(round_up(ceil_div(vecs, nv), kWarpSize));
      s.path = wide ? Path::kWideRegisters : Path::kRegisters;
      return s;
    }
  }
  int64_t ctas = ceil_div(vecs, int64_t{kMaxThreads} * reg_nv);
  const bool large_cluster = large_registers && large_threads > 0 &&
                             ctas >= large_cluster_min && (ctas <= max_cluster || !wide);
  if (cluster_registers == ClusterRegisters::kAll ||
      (cluster_registers == ClusterRegisters::kLargeCtas && large_cluster)) {
    s.path = Path::kRegisterCluster;
    if (large_cluster) {
      ctas = ceil_div(vecs, int64_t{large_threads} * reg_nv);
      s.threads = s.tpr = large_threads;
    } else if (wide && ctas > max_cluster) {
      ctas = ceil_div(vecs, int64_t{s.threads} * wide_nv);
      s.path = Path::kWideRegisterCluster;
    }
  } else {
    ctas = ceil_div(vecs, int64_t{kMaxThreads} * shared_nv);
    s.path = Path::kShared;
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
    s.path = Path::kStream;
  }
  return s;
}

const Shape kStreamShape{kMaxThreads, kMaxThreads, 1, Path::kStream};

// Calls f with the CTA size (a std::integral_constant) that backward_kernel is compiled for
// on kPath with VEC for a launch of `threads` threads: kLargeCtaThreads past kMaxThreads (on
// the shared vector path and the register vector paths of ops with Op::kLargeCtas, the only
// ones compiled so); else kMaxThreads, for launches of up to as many.
template <class Op, Path kPath, int VEC, class F>
decltype(auto) with_cta(int threads, F f) {
  if constexpr (VEC > 1 &&
                (kPath == Path::kShared || (Op::kLargeCtas && kPath != Path::kStream)))
    if (threads > kMaxThreads) return f(std::integral_constant<int, kLargeCtaThreads>{});
  return f(std::integral_constant<int, kMaxThreads>{});
}

// occupancy_units() of the resident backward_kernel (VEC, kPath, kParams, kCache): 0 if none
// fits (the staged rows and cached columns exceed the shared memory a CTA may have). Queried
// once per device, CTA size and cluster size.
template <class Op, typename T, int VEC, Path kPath, bool kParams, bool kCache, int kR = 1,
          int kCta = kMaxThreads>
int64_t resident_backward_units(int device, int threads, int cluster, int sm_count) {
  static std::atomic<int> cache[kCta / kWarpSize + 1][kMaxCluster + 1][kMaxDevices];
  return once_per_device(cache[threads / kWarpSize][cluster], device, [&](int) {
    constexpr int NV = path_nv<Op>(kPath, VEC, kParams);
    const auto kernel = backward_kernel<Op, T, VEC, NV, kPath, kParams, kCache, kR, kCta>;
    const int64_t smem = resident_backward_smem<Op>(kPath, VEC, NV, threads, kParams,
                                                    kCache ? Op::kColumnValues : 0, kR);
    return occupancy_units(kernel, threads, cluster, static_cast<size_t>(smem), sm_count);
  });
}

using Registers = std::integral_constant<Path, Path::kRegisters>;
using WideRegisters = std::integral_constant<Path, Path::kWideRegisters>;
using RegisterCluster = std::integral_constant<Path, Path::kRegisterCluster>;
using WideRegisterCluster = std::integral_constant<Path, Path::kWideRegisterCluster>;
using Shared = std::integral_constant<Path, Path::kShared>;
using One = std::integral_constant<int, 1>;

// How a backward pass is launched: the vector width, the thread shape and the grid.
struct Launch {
  bool vec = false;
  bool cache = false;  // resident vector rows with the column cache (see ColumnCache)
  int shared_rows = 1;  // rows per row group and step on the shared path (kR)
  Shape shape;
  int64_t grid = 0;          // CTAs
  int64_t partial_rows = 0;  // P: scratch rows per wanted parameter gradient
  int64_t smem_sums_bytes = 0;  // streaming path's parameter gradient sums in shared memory
  int64_t column_tiles = 0;     // > 0: the sums by column_sums_kernel, P row slices of tiles
};

// How many times over plan_launch's grid holds the resident CTAs (clusters) of `shape`. Four
// for clusters of up to 8 on the shared path that neither sums parameter gradients nor caches
// columns (16-bit log_softmax): each then stages and writes about a quarter of the rows it
// would striding over them all, and the hardware starts the next as clusters finish, which
// evens out the end. H100, 2^26 elements, bf16 log_softmax_ backward, ratio to
// clone-equivalent bandwidth, one grid -> four: N = 16384 / 32768 / 65536 0.808 / 0.797 /
// 0.776 -> 0.841 / 0.822 / 0.803 (fp16 at 32768 0.801 -> 0.821; eight grids: 0.857 / 0.815 /
// 0.791); clusters of 16 (N = 131072) 0.760 -> 0.748. The others lost with every larger grid
// tried (bf16 LayerNorm with both parameter gradients at N = 4096 0.825 -> 0.735 with two
// grids, softmax_ on cluster registers at 16384 0.866 -> 0.856): each CTA's setup (the
// column cache, its scratch row of the parameter gradients) is paid once per CTA, so the more
// often the larger the grid. (The forward sizes its grid by rows_per_unit, rowwise.cuh.)
// 0: a CTA per row group, none striding, for softmax's register rows (its 16-bit rows of more
// than a warp one to a CTA, see one_row_per_cta) and softmax_'s wide 16-bit rows, and
// log_softmax_'s on CTAs of kMaxThreads where its exps are cheap (its others take two grids;
// `cluster_registers` tells them apart, see SoftmaxBackwardOp): the next row's prefetch then
// has nothing to hide that the hardware's next CTA does not. H100, 2^26 elements, backward,
// ratio to clone-equivalent bandwidth, striding -> a CTA per row group, two sweeps each: fp32
// softmax_ at N = 256-1024 / 2048-8192 0.94 / 0.95 -> 0.99, fp32 log_softmax_ 0.92 / 0.93 ->
// 0.99 / 0.98; 16-bit softmax_ at 256-1024 0.91 -> 0.96-0.97, log_softmax_ 0.88-0.89 -> 0.90;
// wide rows (16384) of bf16 / fp16 softmax_ 0.905 / 0.915 -> 0.94 / 0.95. bf16 log_softmax_'s
// wide rows, with exps of five instructions: 0.888 / 0.884 striding, 0.918 / 0.918 with two
// grids, 0.901 / 0.905 with four, 0.86 with a CTA per row group; with with_exp's two (stop 53,
// bf16 and fp16 alike), two grids -> a CTA per row group: 0.924 -> 0.959 at 16384, but 0.93 ->
// 0.91 at 32768 (one large CTA per row). Not taken: 16-bit rows of a CTA while they shared
// CTAs of kMaxThreads (N = 2048-8192, 0.94 -> 0.86 with a CTA per row group, 0.94 / 0.92 with
// two grids; log_softmax_ 0.93 -> 0.79 / 0.92; one row per CTA took them, see
// one_row_per_cta), fp32 clusters (16384, 0.88 -> 0.81; two or four grids: -1% to +1% for
// softmax_, -1% to -4% for log_softmax_ at 16384-65536) and 16-bit softmax_'s (two or four
// grids: 0.85 -> 0.84 / 0.82 at 32768).
template <class Op>
constexpr int64_t grid_waves(const Shape& shape, bool params, bool cache,
                             ClusterRegisters cluster_registers) {
  if (always_cta_per_group<Op>(shape.path)) return 0;
  if (!Op::kHasParams && shape.path == Path::kWideRegisters) {
    const bool per_group = cluster_registers == ClusterRegisters::kAll ||
                           (cluster_registers == ClusterRegisters::kLargeCtas &&
                            shape.threads == kMaxThreads);
    return per_group ? 0 : 2;
  }
  return shape.path == Path::kShared && !params && !cache && shape.cluster <= 8 ? 4 : 1;
}

// `aligned`: every row (and side input) is 16-byte aligned with col_stride 1. Resident rows
// run on as many CTAs (clusters) as fit on the GPU at once (grid_waves() times that), each
// striding over rows (which its staging needs), or where grid_waves() says so on a CTA per
// row group; vector rows that fit on no SM (or in no
// cluster that fits) are streamed. With parameter gradients, the grid is capped so that the
// scratch stays within its bound.
template <class Op, typename T>
Launch plan_launch(const BackwardRows& L, bool aligned, int param_arrays, int device,
                   const DeviceInfo& dev,
                   ClusterRegisters cluster_registers = ClusterRegisters::kNone) {
  const int sm_count = dev.sm_count;
  Launch l;
  const int64_t n = L.y.n;
  l.vec = aligned && n % kVec<T> == 0;
  const int vec = l.vec ? kVec<T> : 1;
  const bool params = param_arrays > 0;
  const int wide_nv = has_wide_registers<Op>() ? path_nv<Op>(Path::kWideRegisters, vec, params) : 0;
  const auto shape = [&](bool large) {
    return pick_shape(ceil_div(n, vec), path_nv<Op>(Path::kRegisters, vec, params), wide_nv,
                      path_nv<Op>(Path::kShared, vec, params),
                      !l.vec ? 0 : dev.cluster_launch ? kMaxCluster : 1,
                      l.vec && one_row_per_cta<Op, T>(), cluster_registers,
                      large ? kLargeCtaThreads : 0, Op::kLargeCtas, Op::kLargeClusterMin);
  };
  // Vector rows only: scalar rows keep kScalarNV elements per thread on CTAs of kMaxThreads.
  l.shape = shape(l.vec);
  // Row groups (CTAs or clusters) the grid may hold: from the resident ones (below), else
  // (streamed rows) as many CTAs as the SMs' threads allow.
  int64_t max_units = 0;
  if (l.shape.path != Path::kStream) {
    const auto resident = [&](auto params_const, auto cache_const, auto rows_const) -> int64_t {
      constexpr bool kParams = decltype(params_const)::value;
      constexpr bool kCache = decltype(cache_const)::value;
      constexpr int kR = decltype(rows_const)::value;
      const int threads = l.shape.threads, cluster = l.shape.cluster;
      if (!l.vec) {
        if constexpr (kCache) return 0;  // the scalar path reads its columns from global memory
        return resident_backward_units<Op, T, 1, Path::kRegisters, kParams, false>(
            device, threads, cluster, sm_count);
      }
      // 0 where the op caches no columns on the path.
      const auto on = [&](auto path_const) -> int64_t {
        constexpr Path kPath = decltype(path_const)::value;
        if constexpr ((kCache && !Op::template kCacheColumns<kPath>) ||
                      (kR > 1 && kPath != Path::kShared)) {
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
        if (l.shape.path == Path::kWideRegisters) return on(WideRegisters{});
        if (l.shape.path == Path::kWideRegisterCluster) return on(WideRegisterCluster{});
      }
      if constexpr (Op::kClusterRegisters)
        if (l.shape.path == Path::kRegisterCluster) return on(RegisterCluster{});
      return l.shape.path == Path::kShared ? on(Shared{}) : on(Registers{});
    };
    // The cache, and then rows taken Op::kSharedRows at a time, where they cost no
    // occupancy (their shared memory may leave fewer CTAs per SM).
    const auto fitting = [&](auto params_const) {
      const int64_t plain = resident(params_const, std::false_type{}, One{});
      const int64_t cached = resident(params_const, std::true_type{}, One{});
      l.cache = cached > 0 && cached >= plain;
      const int64_t units = l.cache ? cached : plain;
      if constexpr (Op::kSharedRows > 1) {
        if (l.cache && l.shape.path == Path::kShared && l.shape.cluster > kGroupedRowsCluster) {
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
      if (l.shape.path != Path::kStream) fits = fits_of();
    }
    if (fits > 0) {
      const int64_t waves = grid_waves<Op>(l.shape, params, l.cache, cluster_registers);
      max_units = waves > 0 ? fits * waves : std::numeric_limits<int>::max() / l.shape.cluster;
    } else if (l.vec) {
      l.shape = kStreamShape;
    }
  }
  if (max_units == 0) max_units = int64_t{sm_count} * (kThreadsPerSm / l.shape.threads);
  const int64_t rows_per_cta = l.shape.threads / l.shape.tpr * l.shared_rows;
  const int64_t row_groups = ceil_div(L.y.rows, rows_per_cta);
  if (params) {
    const int64_t bound =
        std::max(kScratchFloor, L.y.rows * n * static_cast<int64_t>(sizeof(T)) / 4);
    // Scratch of one CTA (or cluster), whose row groups fill one row per array together.
    const int64_t per_unit = n * param_arrays * static_cast<int64_t>(sizeof(float));
    // Streamed rows sum in shared memory where a CTA's sums fit (two CTAs per multiprocessor,
    // as the launch bounds ask, or else one; 1 KiB stays for the kernel's static shared
    // memory). Where they fit in none, column_sums_kernel sums them in a pass of its own. (A
    // read-modify-write of the CTA's scratch rows in global memory per row, 8 bytes per
    // element and array, measured 3-7x slower on an H100: 0.05-0.16x of clone-equivalent
    // bandwidth for LayerNorm at N = 65536.)
    const int64_t room = dev.smem_optin - 1024;
    const int fit = per_unit <= room / 2 ? 2 : per_unit <= room ? 1 : 0;
    if (l.shape.path == Path::kStream && fit == 0) {
      l.column_tiles = ceil_div(n, int64_t{kWarpSize} * vec);
      // Enough CTAs to fill the GPU a few times over, each slice a scratch row within bound.
      const int64_t slices = std::min({ceil_div(int64_t{sm_count} * 8, l.column_tiles),
                                       ceil_div(L.y.rows, int64_t{kSlices}),
                                       bound / (n * param_arrays * int64_t{sizeof(float)})});
      // backward_kernel then writes grad_x only: no scratch rows bound its grid.
      l.grid = std::max<int64_t>(1, std::min(row_groups, max_units));
      l.partial_rows = L.y.rows == 0 ? 0 : std::max<int64_t>(1, slices);
      return l;
    }
    max_units = std::min(max_units, std::max<int64_t>(1, bound / per_unit));
    if (l.shape.path == Path::kStream) {
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
  const unsigned grid = static_cast<unsigned>(l.grid);
  if (l.shape.path == Path::kStream) {
    const auto kernel =
        backward_kernel<Op, T, VEC, path_nv<Op>(Path::kStream, VEC, kParams), Path::kStream,
                        kParams, false>;
    Partials p = part;
    p.smem_sums = l.smem_sums_bytes > 0;
    if (p.smem_sums) {
      const cudaError_t err = cudaFuncSetAttribute(kernel,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(l.smem_sums_bytes));
      if (err != cudaSuccess) return err;
    }
    kernel<<<grid, l.shape.threads, l.smem_sums_bytes, stream>>>(y, dy, dx, L, op, l.shape.tpr,
                                                                 1, p);
    return cudaGetLastError();
  }
  // resident_backward_units, called by plan_launch, has lifted the shared memory limit and
  // allowed the cluster size.
  const auto resident = [&](auto path_const, auto cache_const, auto rows_const) {
    constexpr Path kPath = decltype(path_const)::value;
    constexpr bool kCache = decltype(cache_const)::value;
    constexpr int kR = decltype(rows_const)::value;
    constexpr int NV = path_nv<Op>(kPath, VEC, kParams);
    const auto kernel = with_cta<Op, kPath, VEC>(l.shape.threads, [](auto cta) {
      return backward_kernel<Op, T, VEC, NV, kPath, kParams, kCache, kR, decltype(cta)::value>;
    });
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(static_cast<unsigned>(l.shape.threads));
    config.dynamicSmemBytes = static_cast<size_t>(resident_backward_smem<Op>(
        kPath, VEC, NV, l.shape.threads, kParams, kCache ? Op::kColumnValues : 0, kR));
    config.stream = stream;
    cudaLaunchAttribute dims = cluster_dims(l.shape.cluster);
    config.attrs = &dims;
    config.numAttrs = l.shape.cluster > 1 ? 1 : 0;
    const cudaError_t err = cudaLaunchKernelEx(&config, kernel, y, dy, dx, L, op, l.shape.tpr,
                                               l.shape.cluster, part);
    return err != cudaSuccess ? err : cudaGetLastError();
  };
  if constexpr (VEC > 1) {
    if (l.cache) {  // (plan_launch sets it only where the op caches on the path)
      if constexpr (Op::template kCacheColumns<Path::kShared>) {
        if constexpr (Op::kSharedRows > 1)
          if (l.shape.path == Path::kShared && l.shared_rows > 1)
            return resident(Shared{}, std::true_type{},
                            std::integral_constant<int, Op::kSharedRows>{});
        if (l.shape.path == Path::kShared) return resident(Shared{}, std::true_type{}, One{});
      }
      if constexpr (Op::template kCacheColumns<Path::kRegisters>)
        if (l.shape.path == Path::kRegisters)
          return resident(Registers{}, std::true_type{}, One{});
    }
    if (l.shape.path == Path::kShared) return resident(Shared{}, std::false_type{}, One{});
    if constexpr (has_wide_registers<Op>()) {
      if (l.shape.path == Path::kWideRegisters)
        return resident(WideRegisters{}, std::false_type{}, One{});
      if (l.shape.path == Path::kWideRegisterCluster)
        return resident(WideRegisterCluster{}, std::false_type{}, One{});
    }
    if constexpr (Op::kClusterRegisters)
      if (l.shape.path == Path::kRegisterCluster)
        return resident(RegisterCluster{}, std::false_type{}, One{});
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

bool all_rows_aligned(const void* y, const void* dy, const void* dx, const BackwardRows& L,
                      int64_t elem) {
  return L.y.col_stride == 1 && L.grad.col_stride == 1 && rows_aligned(y, L.y.row, elem, 16) &&
         rows_aligned(dy, L.grad.row, elem, 16) &&
         (dx == nullptr || (L.grad_x.col_stride == 1 && rows_aligned(dx, L.grad_x.row, elem, 16)));
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
  const Launch l = plan_launch<Op, T>(L, aligned, 0, device, dev, op.cluster_registers());
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
  // 1.4x the time of the unmasked kernel (H100, N = 1024-8192). That holds for a finite grad;
  // a non-finite one at a dropped element makes s, hence the whole row's grad_x, NaN either
  // way (s sums grad * y over every element).
  switch (params.log ? mask_layout.kind : MaskKind::kNone) {
    case MaskKind::kBool:
      return launch_softmax_masked<T, MaskKind::kBool>(y, grad, grad_x, rows, mask, mask_layout,
                                                       params, stream);
    case MaskKind::kAdditive:
      return launch_softmax_masked<T, MaskKind::kAdditive>(y, grad, grad_x, rows, mask,
                                                           mask_layout, params, stream);
    case MaskKind::kNone:
      break;
  }
  return launch_softmax_masked<T, MaskKind::kNone>(y, grad, grad_x, rows, mask, mask_layout,
                                                   params, stream);
}

namespace {

bool norm_aligned(const void* y, const void* dy, const void* dx, const BackwardRows& L,
                  const void* weight, const void* bias, int64_t elem) {
  const RowIndexer one_row;  // ndim 0: only the base pointer is checked
  return all_rows_aligned(y, dy, dx, L, elem) &&
         (weight == nullptr || rows_aligned(weight, one_row, elem, 16)) &&
         (bias == nullptr || rows_aligned(bias, one_row, elem, 16));
}

}  // namespace

template <typename T>
cudaError_t norm_backward_scratch(const BackwardRows& rows, bool want_weight, bool want_bias,
                                  int64_t* scratch_floats) {
  *scratch_floats = 0;
  const int arrays = int{want_weight} + int{want_bias};
  if (arrays == 0 || rows.y.n == 0) return cudaSuccess;
  int device = 0;
  DeviceInfo dev;
  const cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  // The widest launch (vector path): its grid is capped by the same bound, and the scalar path
  // of the same rows never needs more partial rows than the bound allows either.
  const Launch l =
      plan_launch<NormBackwardOp<T>, T>(rows, /*aligned=*/true, arrays, device, dev);
  const Launch ls =
      plan_launch<NormBackwardOp<T>, T>(rows, /*aligned=*/false, arrays, device, dev);
  *scratch_floats = std::max(l.partial_rows, ls.partial_rows) * rows.y.n * arrays;
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_norm_backward(const T* y, const T* grad, T* grad_x, const BackwardRows& rows,
                                 const T* weight, const T* bias, const float* rstd, bool rms,
                                 T* grad_weight, T* grad_bias, float* scratch,
                                 int64_t scratch_floats, cudaStream_t stream) {
  const int64_t n = rows.y.n;
  const int arrays = int{grad_weight != nullptr} + int{grad_bias != nullptr};
  if (n == 0 || (rows.y.rows == 0 && arrays == 0)) return cudaSuccess;
  int device = 0;
  DeviceInfo dev;
  cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  NormBackwardOp<T> op;
  op.weight = weight;
  op.bias = bias;
  op.rstd = rstd;
  op.inv_n = 1.f / static_cast<float>(n);
  op.rms = rms;
  const bool aligned = norm_aligned(y, grad, grad_x, rows, weight, bias, sizeof(T));
  const Launch l = plan_launch<NormBackwardOp<T>, T>(rows, aligned, arrays, device, dev);
  if (l.partial_rows * n * arrays > scratch_floats) return cudaErrorInvalidValue;
  Partials part{nullptr, nullptr};
  if (grad_weight) part.w = scratch;
  if (grad_bias) part.b = scratch + (grad_weight ? l.partial_rows * n : 0);
  if (rows.y.rows > 0 && l.column_tiles > 0) {
    err = launch_paths(y, grad, grad_x, rows, op, l, Partials{nullptr, nullptr}, stream);
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(l.column_tiles), static_cast<unsigned>(l.partial_rows));
    if (l.vec)
      column_sums_kernel<T, kVec<T>><<<grid, kMaxThreads, 0, stream>>>(y, grad, rows, op, part);
    else
      column_sums_kernel<T, 1><<<grid, kMaxThreads, 0, stream>>>(y, grad, rows, op, part);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  } else if (rows.y.rows > 0) {
    err = launch_paths(y, grad, grad_x, rows, op, l, part, stream);
    if (err != cudaSuccess) return err;
  }
  if (arrays == 0) return cudaSuccess;
  // 16-byte loads where every partial row is 16-byte aligned (the scratch is, and n % 4 == 0
  // keeps the rows so).
  constexpr int kSumVec = 4;
  const bool vec = n % kSumVec == 0 && reinterpret_cast<uintptr_t>(scratch) % 16 == 0;
  const int slices = static_cast<int>(
      std::min<int64_t>(kSumMaxSlices, next_pow2(std::max<int64_t>(1, l.partial_rows))));
  const int64_t cols = int64_t{kMaxThreads} / slices * (vec ? kSumVec : 1);
  const dim3 grid(static_cast<unsigned>(ceil_div(n, cols)), static_cast<unsigned>(arrays));
  if (vec)
    sum_partials_kernel<T, kSumVec><<<grid, kMaxThreads, 0, stream>>>(
        part, l.partial_rows, n, slices, weight, grad_weight, grad_bias);
  else
    sum_partials_kernel<T, 1><<<grid, kMaxThreads, 0, stream>>>(part, l.partial_rows, n, slices,
                                                                weight, grad_weight, grad_bias);
  return cudaGetLastError();
}

#define MTI_INSTANTIATE_BACKWARD(T)                                                            \
  template cudaError_t launch_softmax_backward<T>(const T*, const T*, T*, const BackwardRows&, \
                                                  const void*, const MaskLayout&,              \
                                                  const SoftmaxParams&, cudaStream_t);         \
  template cudaError_t norm_backward_scratch<T>(const BackwardRows&, bool, bool, int64_t*);    \
  template cudaError_t launch_norm_backward<T>(const T*, const T*, T*, const BackwardRows&,    \
                                               const T*, const T*, const float*, bool, T*, T*, \
                                               float*, int64_t, cudaStream_t);

MTI_INSTANTIATE_BACKWARD(float)
MTI_INSTANTIATE_BACKWARD(__half)
MTI_INSTANTIATE_BACKWARD(__nv_bfloat16)

}  // namespace mti
