// The framework shared by the row-wise ops (softmax/log_softmax, LayerNorm, RMSNorm): a row is
// read into registers, reduced to a per-row state, transformed and written back over itself.
// The op-specific part is a functor (the "Op" below); this file owns memory access, the mapping
// of threads to rows, the reductions and the choice of launch configuration.
//
// Paths (RowPath), chosen by launch_rows():
//  - kResident: the row stays in registers from its read to its write, held by a group of <= 32
//    lanes (several rows per CTA) or by a whole CTA of up to kMaxThreads threads.
//  - kCluster: the same for longer rows, held by a CTA of exactly kMaxThreads threads or, on
//    sm_90+, by a cluster of up to 16 of them that reduce over distributed shared memory.
//  - kStashed: kCluster with each thread holding as much of the row again in shared memory.
//  - kStream: rows too long for the above: the row is read once to reduce and once more to
//    write.
// With col_stride 1, 16-byte aligned rows (and weight/bias, mask rows) and N a multiple of VEC
// every access moves 16 bytes (VEC elements); anything else (col_stride != 1, unaligned rows,
// odd N) runs the same paths with VEC = 1, element by element.
//
// Op concept (see kernels/softmax.cu and kernels/norm.cu):
//   using State;                    reduction state, see kernels/reduce.cuh
//   static constexpr float kPad;    value of a column that is not read: past the row's end or
//                                   past its causal limit. local() must treat it as absent.
//   static constexpr bool kKeepsX;  prepare() and local() leave z equal to x (as floats), so
//                                   a stashed step may be parked in shared memory as T
//   template <typename T> static constexpr int kCtaRowRegs;   values per thread where a CTA
//                                   of up to kMaxThreads threads holds a row
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
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/reduce.cuh"
#include "kernels/row_layout.h"

namespace mti {

// Elements of T per 16-byte access.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// Row values one thread keeps in registers on the vector paths (fp32 registers; with 16-bit
// types that is as many elements). Rows of up to a warp keep at most kWarpRegs per thread,
// rows of a CTA Op::kCtaRowRegs<T> (see the Op concept), longer rows kCtaRegs: with the ~35
// registers of bookkeeping a CTA of kMaxThreads threads then needs <= 128 registers per
// thread, so two CTAs fit on an SM, one loading while the other reduces or writes. A CTA
// holds kMaxThreads * kCtaRegs = 16384 values, a cluster of 16 CTAs 262144. (CTAs of 512
// threads, one per SM, each holding twice as much of the row, lost up to 42% at N =
// 32768-262144 on an H100, in every cell but fp32 RMSNorm's at 32768 (+2%), where the
// backward's gained: see kLargeCtaThreads in kernels/rowwise_backward.cu and
// benchmarks/results/rowwise_cluster_profile.md, stop 47.)
constexpr int kWarpRegs = 32;
constexpr int kCtaRegs = 64;
// Values per thread and step when streaming: fewer keep the two-pass kernel clear of spills.
constexpr int kStreamRegs = 16;
// Elements per thread and step on the scalar path.
constexpr int kScalarNV = 8;
// CTA size when several rows share a CTA (one row per group of <= 32 lanes).
constexpr int kSmallRowThreads = 128;

template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

// Folds get(0), ..., get(COUNT - 1) with the associative `op` into up to 8 independent
// partials, then folds those pairwise: a chain of COUNT dependent operations would leave the
// warp waiting on each one's latency. COUNT is a power of two (NV * VEC).
template <int COUNT, class Get, class Op>
__device__ __forceinline__ float fold(Get get, Op op) {
  static_assert(COUNT > 0 && (COUNT & (COUNT - 1)) == 0, "COUNT must be a power of two");
  constexpr int kPartials = COUNT < 8 ? COUNT : 8;
  float acc[kPartials];
#pragma unroll
  for (int i = 0; i < kPartials; ++i) acc[i] = get(i);
#pragma unroll
  for (int i = kPartials; i < COUNT; ++i) acc[i % kPartials] = op(acc[i % kPartials], get(i));
#pragma unroll
  for (int w = kPartials / 2; w > 0; w /= 2)
#pragma unroll
    for (int i = 0; i < w; ++i) acc[i] = op(acc[i], acc[i + w]);
  return acc[0];
}

struct Add {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Min {
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};

// The Aux of an op that reads nothing but x.
struct NoAux {};

// Per-column inputs that an op's output() applies (a norm's weight and bias): K pointers, each
// to n contiguous elements (16-byte aligned on the vector paths) or nullptr, and the value that
// every column of an absent one takes (1 for a weight, 0 for a bias).
template <typename T, int K>
struct ColumnParams {
  const T* ptr[K];
  float absent[K];
};
template <typename T>
struct ColumnParams<T, 0> {};

// The K params of one vector's columns, as floats.
template <int K, int VEC>
struct ParamValues {
  float v[K][VEC];
};
template <int VEC>
struct ParamValues<0, VEC> {};

// The vector of VEC elements from column c0 of a row. VEC > 1 only where col_stride is 1, row
// starts are 16-byte aligned and n is a multiple of VEC, so a vector that starts in the row
// lies in it whole. Col is int on the resident paths (rows shorter than 2^31), int64_t else.
// kKeepInL2: see load_keep_in_l2.
template <int VEC, bool kKeepInL2 = false, typename T, typename Col>
__device__ __forceinline__ Packed<T, VEC> load_vec(const T* row, Col c0, int64_t col_stride) {
  const auto* at = reinterpret_cast<const Packed<T, VEC>*>(row + c0 * (VEC == 1 ? col_stride : 1));
  if constexpr (kKeepInL2)
    return load_keep_in_l2(at);
  else
    return *at;
}

// A vector as fp32. A bfloat16 is the top half of a float: the two elements of a 32-bit word
// widen with one shift and one mask (kWidensPairs), where converting them one by one costs a
// byte permute and a shift for the upper one (and, in the norm backward kernels, the generic
// conversion's inline asm kept the packed and widened copies alive together and spilled).
template <typename T, int VEC>
constexpr bool kWidensPairs = std::is_same_v<T, __nv_bfloat16> && VEC % 2 == 0;

template <int VEC, typename T>
__device__ __forceinline__ void to_floats(float (&f)[VEC], const Packed<T, VEC>& p) {
  if constexpr (kWidensPairs<T, VEC>) {
    uint32_t words[VEC / 2];
    memcpy(words, &p, sizeof(words));
#pragma unroll
    for (int w = 0; w < VEC / 2; ++w) {
      f[2 * w] = __uint_as_float(words[w] << 16);
      f[2 * w + 1] = __uint_as_float(words[w] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) f[j] = to_float(p.v[j]);
  }
}

template <int VEC, typename T, typename Col>
__device__ __forceinline__ void store_vec(T* row, Col c0, int64_t col_stride,
                                          const float (&v)[VEC]) {
  Packed<T, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = from_float<T>(v[j]);
  if constexpr (VEC == 1)
    row[c0 * col_stride] = p.v[0];
  else
    *reinterpret_cast<Packed<T, VEC>*>(row + c0) = p;
}

// How many of the VEC elements from column c0 on lie before `limit` (0..VEC).
template <int VEC, typename Col>
__device__ __forceinline__ int count_before(Col limit, Col c0) {
  const Col left = limit - c0;
  return left <= 0 ? 0 : left >= VEC ? VEC : static_cast<int>(left);
}

// Where one thread's vectors of one step lie: vector k is vector v0 + k * stride of the row.
// kStride > 0 fixes the stride at compile time, which turns the per-vector offsets into
// immediates (with a runtime stride the compiler keeps one offset per vector in registers).
template <typename Col, int kStride>
struct StepCursor {
  Col v0;
  int runtime_stride;
  __device__ __forceinline__ Col col(int k, int vec) const {
    return (v0 + k * (kStride > 0 ? kStride : runtime_stride)) * vec;
  }
};

// Where read_vectors() gets x's vectors from: global memory, or the copy of them that
// stage_step() prefetched into shared memory.
template <int VEC, typename T>
struct GlobalVectors {
  const T* row;
  int64_t col_stride;
  template <typename Col>
  __device__ __forceinline__ Packed<T, VEC> operator()(int, Col c0) const {
    return load_vec<VEC>(row, c0, col_stride);
  }
};

// A thread's staged vectors (stage_step; the backward kernels' prefetch): vector k of its
// step sits at slots[k * stride]. With the threads of a CTA side by side (stride =
// blockDim.x), a warp reads 512 contiguous bytes.
template <int VEC, typename T>
struct StagedVectors {
  const Packed<T, VEC>* slots;
  int stride;
  template <typename Col>
  __device__ __forceinline__ Packed<T, VEC> operator()(int k, Col) const {
    return slots[k * stride];
  }
};

// The K params of one vector's columns as read, in their own type: held so until used, they
// take half the registers of ParamValues in 16-bit rows.
template <typename T, int K, int VEC>
struct ParamVectors {
  Packed<T, VEC> v[K];
};
template <typename T, int VEC>
struct ParamVectors<T, 0, VEC> {};

template <typename T, int K, int VEC>
__device__ __forceinline__ ParamValues<K, VEC> param_values(const ParamVectors<T, K, VEC>& p) {
  ParamValues<K, VEC> f;
  if constexpr (K > 0) {
#pragma unroll
    for (int i = 0; i < K; ++i) to_floats(f.v[i], p.v[i]);
  }
  return f;
}

// Where write_vectors() reads param i of a thread's vector k (at column c0) from: for the
// first kCached of the thread's K * NV param vectors (NV: the vectors it holds of a row, over
// all its steps), in the order (i, k), its slots in shared memory (see cache_param), vector k
// of param i at slots[(i * NV + k) * stride]; for the others global memory, or their value if
// absent (1 or 0, exact in every T).
template <int NV, int VEC, typename T, int K, int kCached>
struct ParamReader {
  const ColumnParams<T, K>& params;
  const Packed<T, VEC>* slots;
  int stride;
  template <typename Col>
  __device__ __forceinline__ ParamVectors<T, K, VEC> operator()(int k, Col c0) const {
    ParamVectors<T, K, VEC> p;
    if constexpr (K > 0) {
#pragma unroll
      for (int i = 0; i < K; ++i) {
        if (i * NV + k < kCached) {
          p.v[i] = slots[(i * NV + k) * stride];
        } else if (params.ptr[i] != nullptr) {
          p.v[i] = load_vec<VEC>(params.ptr[i], c0, 1);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) p.v[i].v[j] = from_float<T>(params.absent[i]);
        }
      }
    }
    return p;
  }
};

// Starts copying `param` (or writes its value where absent) at this thread's first `count` vectors
// that start before n into its slots: vector k to slots[k * stride]. Off the streaming path a
// thread owns the same columns of every row it handles, so a cached param is read from global
// memory once per CTA, not once per row: for a long row the params miss L1, and their loads held
// up the stores of the write loop (H100: fp32 RMSNorm at N = 262144 ran at 0.70x of a copy with a
// weight, 0.93x with it cached). cp.async, so that the copies run alongside the first row's loads
// (one after another they held each CTA's start up), and through L1 (.ca), which the CTAs of an SM
// that own the same columns share: through L2 alone (.cg) 16-bit LayerNorm at N = 2048-8192 ran at
// 0.76-0.84x of a copy, through L1 at 0.91-0.92x (when rows of a CTA still cached their params, see
// launch_caching).
template <int VEC, typename T, typename Col, int kStride>
__device__ __forceinline__ void cache_param(Packed<T, VEC>* slots, int stride, int count,
                                            const T* param, float absent,
                                            const StepCursor<Col, kStride>& at, Col n) {
  static_assert(sizeof(Packed<T, VEC>) == 16, "cp.async copies 16-byte vectors");
  Packed<T, VEC> value;
#pragma unroll
  for (int j = 0; j < VEC; ++j) value.v[j] = from_float<T>(absent);
  // Not unrolled: nothing waits on a copy here, and unrolled the addresses took registers that
  // the row needs (a spill in fp32 RMSNorm's cluster kernel).
#pragma unroll 1
  for (int k = 0; k < count; ++k) {
    const Col c0 = at.col(k, VEC);
    if (c0 >= n) continue;
    if (param != nullptr)
      copy16<true>(&slots[k * stride], param + c0, true);
    else
      slots[k * stride] = value;
  }
}

// Starts copying this thread's vectors of one step that begin before `load_end` into its
// slots (the layout of StagedVectors) in the background: one cp.async commit group.
template <int NV, int VEC, typename T, typename Col, int kStride>
__device__ __forceinline__ void stage_step(Packed<T, VEC>* slots, int stride, const T* row,
                                           const StepCursor<Col, kStride>& at, Col load_end) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const Col c0 = at.col(k, VEC);
    if (c0 < load_end) copy16(&slots[k * stride], row + c0, true);
  }
  cp_async_commit();
}

// Side inputs (masks) are read and applied in batches of at most kAuxBatchBytes, after all of
// x's loads are issued: reading a float mask all up front too would hold two copies of the
// step in registers.
constexpr int kAuxBatchBytes = 64;

// Reads one step of NV vectors into z (x -> z via the op, kPad from `load_end` on) and returns
// the op's state of it. A vector is read if it starts before `load_end`; its elements from
// `load_end` on are replaced by kPad. kFull: every vector lies before `load_end` (<= `end`),
// so the accesses are unconditional and every element is a column of the row. All of x's
// loads are issued before any value is used.
template <bool kFull, int NV, int VEC, class Op, class Src, typename Col, int kStride>
__device__ __forceinline__ typename Op::State read_vectors(float (&z)[NV][VEC], const Op& op,
                                                           const Src& src,
                                                           const typename Op::Row& rc,
                                                           const StepCursor<Col, kStride>& at,
                                                           Col load_end, Col end) {
  decltype(src(0, Col{})) raw[NV] = {};
  using T = std::remove_reference_t<decltype(raw[0].v[0])>;
  int cnt[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const Col c0 = at.col(k, VEC);
    cnt[k] = kFull ? VEC : count_before<VEC>(load_end, c0);
    if (cnt[k] > 0) raw[k] = src(k, c0);
  }
  using Aux = typename Op::template Aux<VEC>;
  constexpr int kMaxBatch = kAuxBatchBytes / sizeof(Aux) > 0 ? kAuxBatchBytes / sizeof(Aux) : 1;
  constexpr int kBatch = NV < kMaxBatch ? NV : kMaxBatch;
#pragma unroll
  for (int k0 = 0; k0 < NV; k0 += kBatch) {
    Aux aux[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      op.template load_aux<VEC>(aux[b], rc, at.col(k0 + b, VEC), cnt[k0 + b]);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int k = k0 + b;
      if constexpr (kWidensPairs<T, VEC>) {
        float x[VEC];
        to_floats(x, raw[k]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) z[k][j] = kFull || j < cnt[k] ? x[j] : Op::kPad;
      } else {
        // Element by element, as to_floats would: the same code in another order cost the
        // scalar-path kernels up to 12 registers.
#pragma unroll
        for (int j = 0; j < VEC; ++j) z[k][j] = j < cnt[k] ? to_float(raw[k].v[j]) : Op::kPad;
      }
      op.template prepare<VEC>(z[k], aux[b], rc, cnt[k]);
    }
  }
  int in_row[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) in_row[k] = kFull ? VEC : count_before<VEC>(end, at.col(k, VEC));
  return op.local(z, rc, [&](int k, int j) { return kFull || j < in_row[k]; });
}

// kPerWarp: the full or general path is chosen for the whole warp. Lanes that disagreed would
// run both unrolled paths one after the other, and the general one is right for full steps
// too. Lanes of causal rows (load_end at the row's limit) disagree in most warps: on an H100,
// 16-bit causal softmax took 1.07-1.13x the plain op's time at N = 256-8192 with a branch per
// lane, 1.03-1.07x with the vote (1.02-1.05x with softmax's exp loop chosen per warp too).
// The vote costs a register, which the cluster kernels, at their limit, spill (fp32 softmax
// with a float mask on sm_86/sm_89); their causal rows are long runs of full steps anyway.
template <bool kPerWarp, int NV, int VEC, class Op, class Src, typename Col, int kStride>
__device__ __forceinline__ typename Op::State read_step(float (&z)[NV][VEC], const Op& op,
                                                        const Src& src,
                                                        const typename Op::Row& rc,
                                                        const StepCursor<Col, kStride>& at,
                                                        Col load_end, Col end) {
  const bool full = at.col(NV - 1, VEC) + VEC <= load_end;
  if (kPerWarp ? warp_all(full) : full)
    return read_vectors<true>(z, op, src, rc, at, load_end, end);
  return read_vectors<false>(z, op, src, rc, at, load_end, end);
}

// Turns one step of z into outputs and stores the vectors that start before `end` (and so lie
// in the row whole). Each vector's params are read before the vector ahead of it is stored:
// read in turn, each param load stayed behind the previous vector's store (SASS of 16-bit
// LayerNorm), so every vector waited for its params. H100, forward, ratio to a copy, in turn
// -> read ahead: fp32 LayerNorm 0.934 -> 0.953 at N = 8192, 0.895 -> 0.908 at 16384, 0.782 ->
// 0.801 at 262144 (+1-2% at every N); 16-bit LayerNorm +1% at 4096-8192, +0-1.5% at
// 32768-262144, but 0.920 / 0.916 -> 0.900 / 0.911 at 16384 (bf16 / fp16); RMSNorm +1% in
// fp32 up to 8192 and in 16-bit from 65536 on. Not in 16-bit rows of up to kWarpRegs values
// per thread, whose kernels fit three CTAs per SM in 80 registers: there the read-ahead
// params spilled (LayerNorm, 32 bytes).
template <bool kFull, int NV, int VEC, class Op, class Params, typename T, typename Col,
          int kStride>
__device__ __forceinline__ void write_vectors(float (&z)[NV][VEC], const Op& op,
                                              const typename Op::Out& out, const Params& params,
                                              T* row, const StepCursor<Col, kStride>& at,
                                              int64_t col_stride, Col end) {
  constexpr bool kReadAhead = sizeof(T) == 4 || NV * VEC > kWarpRegs;
  const auto in_row = [&](int k) { return kFull || at.col(k, VEC) < end; };
  const auto write = [&](int k, const auto& p) {
    op.template output<VEC>(z[k], out, param_values(p));
    store_vec<VEC>(row, at.col(k, VEC), col_stride, z[k]);
  };
  if constexpr (kReadAhead) {
    decltype(params(0, Col{})) p = {};
    if (in_row(0)) p = params(0, at.col(0, VEC));
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      auto next = p;
      if (k + 1 < NV && in_row(k + 1)) next = params(k + 1, at.col(k + 1, VEC));
      if (in_row(k)) write(k, p);
      p = next;
    }
  } else {
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (in_row(k)) write(k, params(k, at.col(k, VEC)));
  }
}

template <int NV, int VEC, class Op, class Params, typename T, typename Col, int kStride>
__device__ __forceinline__ void write_step(float (&z)[NV][VEC], const Op& op,
                                           const typename Op::Out& out, const Params& params,
                                           T* row, const StepCursor<Col, kStride>& at,
                                           int64_t col_stride, Col end) {
  if (at.col(NV - 1, VEC) + VEC <= end)
    write_vectors<true>(z, op, out, params, row, at, col_stride, end);
  else
    write_vectors<false>(z, op, out, params, row, at, col_stride, end);
}

// What a stashed step is parked as: x's own type where the op keeps z = x (exact, and a
// 16-bit step takes half the bytes), else floats. 16 bytes of them per slot.
template <class Op, typename T>
using StashOf = std::conditional_t<Op::kKeepsX, T, float>;
template <typename S>
using StashSlot = Packed<S, 16 / sizeof(S)>;

// A thread's z of one step in shared memory (RowPath::kStashed) as S: element e of z (in the
// order [k][j]) at slots[(e / W) * stride].v[e % W], W = 16 / sizeof(S); with the threads of a
// CTA side by side (stride = blockDim.x) a warp moves 512 contiguous bytes and no two lanes
// share a bank.
template <typename S, int NV, int VEC>
__device__ __forceinline__ void stash_step(StashSlot<S>* slots, int stride,
                                           const float (&z)[NV][VEC]) {
  constexpr int W = 16 / sizeof(S);
  static_assert(NV * VEC % W == 0, "a step is whole slots");
#pragma unroll
  for (int q = 0; q < NV * VEC / W; ++q) {
    StashSlot<S> slot;
#pragma unroll
    for (int i = 0; i < W; ++i) slot.v[i] = from_float<S>(z[(q * W + i) / VEC][(q * W + i) % VEC]);
    slots[q * stride] = slot;
  }
}

template <typename S, int NV, int VEC>
__device__ __forceinline__ void unstash_step(float (&z)[NV][VEC], const StashSlot<S>* slots,
                                             int stride) {
  constexpr int W = 16 / sizeof(S);
#pragma unroll
  for (int q = 0; q < NV * VEC / W; ++q) {
    float f[W];
    to_floats(f, slots[q * stride]);
#pragma unroll
    for (int i = 0; i < W; ++i) z[(q * W + i) / VEC][(q * W + i) % VEC] = f[i];
  }
}

// kStashed: a kCluster row of which each thread holds two steps of NV vectors, the first in
// shared memory from its reduction to its write (stash_step), the second in registers. A CTA
// (cluster) then holds twice the row that registers alone do: half the cluster for the same
// row, so that a 16-bit CTA moves as many bytes per row as an fp32 one, and the cluster's
// fixed costs (its reduction, its packing onto the SMs) weigh half as much. launch_rows says
// which rows take it.
enum class RowPath { kResident, kCluster, kStashed, kStream };

// Steps of NV vectors that a thread holds of a row on `path` (see kStashed).
constexpr int held_steps(RowPath path) { return path == RowPath::kStashed ? 2 : 1; }

// CTAs of kMaxThreads threads that row_kernel is compiled to fit on an SM at once; the
// register cap follows (128 per thread for 2, 80 for 3, 64 for 4). More CTAs keep more rows in
// flight: with 3, H100 bf16 LayerNorm at N = 256-1024 ran 4-5% faster. Only 16-bit rows of at
// most kWarpRegs values per thread take more than 2: longer rows need the registers, and fp32
// rows (accurate exp, LayerNorm's TwoSum) spilled on some architectures. Of those, the resident
// rows of ops that read nothing but x (softmax_ and log_softmax_ without a mask) fit in 64
// registers on sm_90+ and take 4 there: H100, 2^26 elements, forward, ratio to a copy at N =
// 256-8192, 0.955-0.983 -> 0.976-0.990 (softmax_), 0.930-0.965 -> 0.976-0.990 (log_softmax_). Older
// architectures spill 4-16 bytes at 64, and so do params or a mask on sm_90a (4 bytes for bf16
// RMSNorm, 26-30 for LayerNorm's rows of a warp, up to 56 with a mask), though the last two ran
// 2% and 6% faster with 4 nonetheless. A stashed CTA's 64 KiB of shared memory leave room for
// one per SM where an SM has less than 164 KiB (sm_75, sm_86, sm_89), which then takes the
// registers of two (with the cap of two, bf16 softmax with an additive mask spilled on sm_86).
template <class Op, typename T>
__host__ __device__ constexpr int min_ctas_per_sm(int values, RowPath path) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 800 && __CUDA_ARCH__ < 900
  if (path == RowPath::kStashed) return 1;
#endif
  if (sizeof(T) != 2 || values > kWarpRegs) return 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kReadsOnlyX =
      Op::kParams == 0 && std::is_same_v<typename Op::template Aux<kVec<T>>, NoAux>;
  if (kReadsOnlyX && path == RowPath::kResident) return 4;
#endif
  return 3;
}

// How many params a launch would cache: up to the last one given (not nullptr).
template <typename T, int K>
int params_to_cache(const ColumnParams<T, K>& params) {
  int count = 0;
  if constexpr (K > 0)
    for (int i = 0; i < K; ++i)
      if (params.ptr[i] != nullptr) count = i + 1;
  return count;
}

// One kernel for every path. kResident and kStream: a row belongs to a group of `tpr`
// threads; tpr <= 32 is a group of lanes (blockDim.x / tpr rows per CTA), tpr > 32 means
// tpr == blockDim.x and the row belongs to the CTA. Thread t of the group owns the row's
// vectors t, t + tpr, t + 2 tpr, ... kCluster: blockDim.x == kMaxThreads and the row belongs
// to a cluster of `cluster` CTAs (1 without clusters); CTA `rank` owns the rank-th run of
// kMaxThreads * NV vectors, in which thread t owns t, t + kMaxThreads, ... Either way a warp
// reads 32 neighbouring vectors at a time. A step is NV vectors per thread: resident rows
// are one step, streamed rows loop over steps twice. The grid strides over rows (groups of
// rows, clusters). The CTAs resident on an SM overlap one another's loads with their
// reductions; prefetching a CTA's next row into shared memory (cp.async) while it reduces
// made 16-bit softmax 3-4% slower at N = 256-16384 on an H100 (and norms slower still).
// The same for the rows of a cluster (the next row copied while the cluster reduces and
// writes; H100, 16-bit, 2^26 elements, ratio to a copy) gained at N = 131072-262144 for
// softmax (0.64 -> 0.69 at 262144) and LayerNorm (0.74 -> 0.77) but lost at N = 32768-65536
// (softmax 0.87 -> 0.85, LayerNorm 0.86 -> 0.81) and for RMSNorm at every N (0.93 -> 0.84).
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
__global__ void __launch_bounds__(kMaxThreads, min_ctas_per_sm<Op, T>(VEC * NV, kPath))
    row_kernel(T* __restrict__ x, const RowLayout layout, const Op op, const int tpr,
               const int cluster) {
  using State = typename Op::State;
  using Vec = Packed<T, VEC>;
  constexpr bool kStream = kPath == RowPath::kStream;
  constexpr bool kClusterRows = kPath == RowPath::kCluster || kPath == RowPath::kStashed;
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
  StashSlot<Stash>* const stash =
      reinterpret_cast<StashSlot<Stash>*>(reinterpret_cast<Vec*>(dynamic_smem) +
                                          kCached * blockDim.x) +
      threadIdx.x;
  constexpr int kStashSlots = NV * VEC * sizeof(Stash) / 16;  // per stashed step and thread
  if constexpr (kCached > 0) {
#pragma unroll
    for (int i = 0; i * kHeldNV < kCached; ++i)
      cache_param(param_slots + i * kHeldNV * blockDim.x, static_cast<int>(blockDim.x),
                  std::min(kHeldNV, kCached - i * kHeldNV), op.params.ptr[i],
                  op.params.absent[i], Cursor{t, lane_group}, static_cast<Col>(layout.n));
    cp_async_commit();
  }
  const ParamReader<kHeldNV, VEC, T, Op::kParams, kCached> params{
      op.params, param_slots, static_cast<int>(blockDim.x)};
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
        const State chunk = read_step<kPerWarp>(z, op, from_global, rc,
                                      Cursor{s * step_vecs + t, lane_group}, load_end, end);
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
    // stashed kernels have no register to spare (bf16 softmax's then spilled 4 bytes on
    // sm_80).
    State total;
    if constexpr (kStream || kPath == RowPath::kStashed)
      total = cta_rows ? warp_allreduce(mine, kWarpSize) : warp_allreduce(mine, tpr);
    else
      total = cta_rows ? warp_allreduce_chunks(mine, kWarpSize)
                       : warp_allreduce_chunks(mine, tpr);
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
        // one-step kernels take the reader itself: fp32 RMSNorm's cluster kernel spilled 8
        // bytes on sm_75 with the step's wrapper.)
        if constexpr (kSteps == 1)
          write_step(z, op, out, params, row, at, col_stride, end);
        else
          write_step(z, op, out, [&](int k, Col c0) { return params(s * NV + k, c0); }, row, at,
                     col_stride, end);
      }
    }
  }
  // No CTA leaves while another may still send it a total.
  if (cluster > 1) cluster_sync();
}

// ---------------------------------------------------------------------------- host side

// Dynamic shared memory of a launch of row_kernel: the cached param vectors, then the stashed
// steps.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached>
constexpr size_t row_smem_bytes(int threads) {
  return (static_cast<size_t>(kCached) * sizeof(Packed<T, VEC>) +
          static_cast<size_t>(held_steps(kPath) - 1) * NV * VEC * sizeof(StashOf<Op, T>)) *
         threads;
}

// occupancy_units() of row_kernel, queried once per device, CTA size and cluster size.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached>
int resident_units(int device, int threads, int cluster, int sm_count) {
  static std::atomic<int> cache[kMaxWarps + 1][5][kMaxDevices];  // threads / 32, log2(cluster)
  int log2c = 0;
  while ((2 << log2c) <= cluster) ++log2c;
  return once_per_device(cache[threads / kWarpSize][log2c], device, [&](int) {
    return occupancy_units(row_kernel<Op, T, VEC, NV, kPath, kCached>, threads, cluster,
                           row_smem_bytes<Op, T, VEC, NV, kPath, kCached>(threads), sm_count);
  });
}

// Row groups that each CTA (cluster) of launch_row_kernel's grid takes on, 0 for as many as
// the CTAs that fit on the GPU at once leave to each (a grid of those, striding over the
// rows). A CTA (cluster) per group or two lets the hardware start a new one on an SM whenever
// one finishes, where resident ones striding over the rows leave some SMs a row more than
// others at the end; but each CTA then pays its setup (cached params, a cluster's exchange).
// H100, 2^26 elements, forward, ratio to a copy's bandwidth, striding -> the kept grid:
//  - plain CTAs, a group each: fp32 softmax at N = 256-16384 0.94 -> 0.98-0.99, bf16 softmax
//    and the norms' rows of up to a warp +1-5%.
//  - a CTA that caches one param (as many vectors as it holds of the row), a row each:
//    RMSNorm at N = 16384 0.937 / 0.949 -> 0.971 / 0.983 (fp32 / bf16; 0.951 / 0.961 with
//    nothing cached), fp32 LayerNorm without bias 0.920 -> 0.960. fp32 LayerNorm with most of
//    its bias cached too fell from 0.893 to 0.788 (0.873 at about two rows per CTA).
//  - clusters of two without params, two rows each: fp32 softmax / log_softmax at N = 32768
//    0.932 / 0.931 -> 0.953 / 0.952, stashed 16-bit ones at 65536 0.901 / 0.897 -> 0.929 /
//    0.925 (bf16 softmax, fp16 log_softmax). A row each lost (0.922, 0.892), as did every
//    grid tried for clusters of four or more (up to 20% for a row each).
//  - a stashed CTA that caches its weight (16-bit RMSNorm at N = 32768), a row each: 0.936 ->
//    0.964 (bf16).
// `cached`: param vectors each thread caches; `nv`: the vectors it holds of a row (both steps
// of a stashed one).
constexpr int64_t rows_per_unit(int cluster, int cached, int nv) {
  if (cluster == 1) return cached <= nv ? 1 : 0;
  return cluster == 2 && cached == 0 ? 2 : 0;
}

// Launches row_kernel on the grid that rows_per_unit() asks for.
template <class Op, typename T, int VEC, int NV, RowPath kPath, int kCached = 0>
cudaError_t launch_row_kernel(T* x, const RowLayout& layout, const Op& op, int threads, int tpr,
                              int cluster, int device, int sm_count, cudaStream_t stream) {
  const int64_t rows_per_cta = tpr > kWarpSize ? 1 : threads / tpr;
  const int64_t row_groups = ceil_div(layout.rows, rows_per_cta);
  const int64_t per_unit = rows_per_unit(cluster, kCached, NV * held_steps(kPath));
  int64_t units = 0;
  if (per_unit > 0) {
    units = std::min<int64_t>(ceil_div(row_groups, per_unit),
                              std::numeric_limits<int>::max() / cluster);
  } else {
    const int resident =
        resident_units<Op, T, VEC, NV, kPath, kCached>(device, threads, cluster, sm_count);
    units = std::min<int64_t>(row_groups, std::max(resident, sm_count / cluster));
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(units * cluster));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = row_smem_bytes<Op, T, VEC, NV, kPath, kCached>(threads);
  config.stream = stream;
  cudaLaunchAttribute dims = cluster_dims(cluster);
  config.attrs = &dims;
  config.numAttrs = cluster > 1 ? 1 : 0;
  const cudaError_t err =
      cudaLaunchKernelEx(&config, row_kernel<Op, T, VEC, NV, kPath, kCached>, x, layout, op,
                         tpr, cluster);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The counts of cached param vectors that launch_caching tries after `cached`: from all the
// vectors of p params (p * nv) to all but a quarter of the last one's, then to p - 1 params'.
constexpr int fewer_cached(int cached, int nv) {
  return cached % nv != 0 ? cached / nv * nv : nv >= 4 ? cached - nv / 4 : cached - nv;
}

// launch_row_kernel() for rows that belong to a cluster (of one CTA or more), with the first
// kCached (at most) of each thread's param vectors cached: only params up to the last one
// given, and as many vectors as fit in shared memory without fewer CTAs resident than with none
// (with fewer, less of the rows is in flight: H100, fp32 LayerNorm at N = 262144 with weight
// and bias cached ran one CTA per SM and at 0.39x of a copy, 0.59x with neither). Of fp32
// LayerNorm's bias all but a quarter fits beside the weight on two CTAs per SM, where only the
// weight (whole params) did: N = 65536 / 131072 / 262144 went from 0.83 / 0.70 / 0.65 to 0.86 /
// 0.84 / 0.79x of a copy (H100; the bias's global loads held up the write loop as the weight's
// did RMSNorm's, see cache_param). Shorter rows do not cache (rows that fill a CTA come here,
// see launch_rows, but cache no more than one param: below): their params stay in L1. (With
// them cached, each CTA striding over the rows as all that cached did then, fp32 LayerNorm at
// N = 256-1024 ran 2-3% slower; at N = 2048-4096 a CTA per row reading its params from L1 ran at
// 0.97-0.99x of a copy (fp32) and 0.96-0.97x (bf16), cached 0.89x and 0.91-0.93x.) See
// rows_per_unit for the grid.
template <class Op, typename T, int VEC, int NV, RowPath kPath,
          int kCached = Op::kParams * NV * held_steps(kPath)>
cudaError_t launch_caching(T* x, const RowLayout& layout, const Op& op, int cluster, int device,
                           int sm_count, cudaStream_t stream) {
  constexpr int kHeldNV = NV * held_steps(kPath);  // vectors a thread holds of a row
  // A row on one CTA caches nothing when the op's second param is given (LayerNorm's bias), the
  // first alone otherwise (a CTA per row either way, see rows_per_unit; uncached, each thread
  // reads its params from L1 in the write loop). H100, LayerNorm at N = 16384, forward, ratio
  // to a copy, as much of both params cached as fits (a persistent grid) / the weight only /
  // none: fp32 0.912-0.915 / 0.894-0.897 / 0.945, bf16 0.929-0.934 / 0.880-0.881 / 0.957-0.959,
  // fp16 0.929-0.931 / 0.888-0.890 / 0.959-0.969. RMSNorm's weight stays cached: bf16 at N =
  // 16384 / 32768 (stashed) 0.984-0.991 / 0.964-0.968 cached, 0.976-0.978 / 0.935-0.936 not.
  if (cluster == 1 && params_to_cache(op.params) > 1)
    return launch_row_kernel<Op, T, VEC, NV, kPath>(x, layout, op, kMaxThreads, kMaxThreads,
                                                    cluster, device, sm_count, stream);
  if constexpr (kCached > 0) {
    const int units = params_to_cache(op.params) * kHeldNV >= kCached
                          ? resident_units<Op, T, VEC, NV, kPath, kCached>(device, kMaxThreads,
                                                                           cluster, sm_count)
                          : 0;
    if (units > 0 &&
        units >= resident_units<Op, T, VEC, NV, kPath, 0>(device, kMaxThreads, cluster, sm_count))
      return launch_row_kernel<Op, T, VEC, NV, kPath, kCached>(
          x, layout, op, kMaxThreads, kMaxThreads, cluster, device, sm_count, stream);
    return launch_caching<Op, T, VEC, NV, kPath, fewer_cached(kCached, kHeldNV)>(
        x, layout, op, cluster, device, sm_count, stream);
  } else {
    return launch_row_kernel<Op, T, VEC, NV, kPath>(x, layout, op, kMaxThreads, kMaxThreads,
                                                    cluster, device, sm_count, stream);
  }
}

inline int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

inline int64_t round_up(int64_t v, int64_t m) { return ceil_div(v, m) * m; }

// Whether `base + offset(r) * elem_bytes` is a multiple of `align` for every row r.
inline bool rows_aligned(const void* base, const RowIndexer& rows, int64_t elem_bytes,
                         int64_t align) {
  if (reinterpret_cast<uintptr_t>(base) % align != 0) return false;
  for (int i = 0; i < rows.ndim; ++i)
    if (rows.sizes[i] > 1 && (rows.strides[i] * elem_bytes) % align != 0) return false;
  return true;
}

inline bool ptr_aligned(const void* p, int64_t align) {
  return reinterpret_cast<uintptr_t>(p) % align == 0;
}

// Picks the path (see the top of this file) and launches it. `aligned`: col_stride is 1 and
// every row start, and every per-column side input the op reads by vectors, is 16-byte
// aligned; with n a multiple of VEC too, the kernels move 16 bytes per access.
template <class Op, typename T>
cudaError_t launch_rows(T* x, const RowLayout& layout, const Op& op, bool aligned,
                        cudaStream_t stream) {
  if (layout.rows == 0 || layout.n == 0) return cudaSuccess;
  int device = 0;
  DeviceInfo dev;
  const cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  const int64_t n = layout.n;

  if (!aligned || n % kVec<T> != 0) {
    if (n <= kWarpSize * kScalarNV) {
      const int tpr = static_cast<int>(next_pow2(ceil_div(n, kScalarNV)));
      return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kResident>(
          x, layout, op, kSmallRowThreads, tpr, 1, device, dev.sm_count, stream);
    }
    if (n <= int64_t{kMaxThreads} * kScalarNV) {
      const int threads = static_cast<int>(round_up(ceil_div(n, kScalarNV), kWarpSize));
      return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kResident>(
          x, layout, op, threads, threads, 1, device, dev.sm_count, stream);
    }
    return launch_row_kernel<Op, T, 1, kScalarNV, RowPath::kStream>(
        x, layout, op, kMaxThreads, kMaxThreads, 1, device, dev.sm_count, stream);
  }

  constexpr int VEC = kVec<T>;
  constexpr int kWarpNV = kWarpRegs / VEC;  // vectors per thread: 8 for fp32, 4 for 16-bit
  constexpr int kCtaNV = kCtaRegs / VEC;
  const int64_t vecs = ceil_div(n, VEC);
  if (vecs <= kWarpSize * kWarpNV) {
    // Up to a warp per row. The fewest lanes that hold the row with at most kWarpNV vectors
    // each: more bytes in flight per thread and fewer shuffles than spreading the row thin.
    const int tpr = static_cast<int>(next_pow2(ceil_div(vecs, kWarpNV)));
    const int64_t nv = next_pow2(ceil_div(vecs, tpr));
    auto launch = [&](auto nv_const) {
      return launch_row_kernel<Op, T, VEC, decltype(nv_const)::value, RowPath::kResident>(
          x, layout, op, kSmallRowThreads, tpr, 1, device, dev.sm_count, stream);
    };
    switch (nv) {
      case 1: return launch(std::integral_constant<int, 1>{});
      case 2: return launch(std::integral_constant<int, 2>{});
      case 4: return launch(std::integral_constant<int, 4>{});
      default: return launch(std::integral_constant<int, kWarpNV>{});
    }
  }
  constexpr int kCtaRowNV = Op::template kCtaRowRegs<T> / VEC;
  // Rows that would take all kMaxThreads threads at kCtaNV vectors each are what the cluster
  // path's CTA holds: ops with params leave them to that path (a cluster of one CTA), which
  // runs them faster. H100, 16-bit LayerNorm at N = 16384 (the only such rows), forward,
  // ratio to a copy, this path / the cluster path: 0.889-0.909 / 0.920-0.923 when the latter
  // cached the params, 0.895-0.910 / 0.951-0.959 with both reading them from L1 (stop 56).
  constexpr int kCtaRowThreads =
      Op::kParams > 0 && kCtaRowNV == kCtaNV ? kMaxThreads - kWarpSize : kMaxThreads;
  if (vecs <= int64_t{kCtaRowThreads} * kCtaRowNV) {  // a CTA per row, as many threads as it takes
    const int threads = static_cast<int>(round_up(ceil_div(vecs, kCtaRowNV), kWarpSize));
    return launch_row_kernel<Op, T, VEC, kCtaRowNV, RowPath::kResident>(
        x, layout, op, threads, threads, 1, device, dev.sm_count, stream);
  }
  // A CTA, or on sm_90+ a cluster of up to kMaxCluster CTAs, per row, kCtaNV vectors per
  // thread in registers, and past what registers hold as much again stashed (kStashed);
  // streamed when no cluster holds the row.
  const int64_t cta_vecs = int64_t{kMaxThreads} * kCtaNV;
  // The smallest cluster whose CTAs of `path` hold the row; 0 if none can run here.
  const auto cluster_for = [&](auto path) {
    constexpr RowPath kPath = decltype(path)::value;
    int cluster = 1;
    while (cluster <= kMaxCluster && vecs > cluster * held_steps(kPath) * cta_vecs) cluster *= 2;
    const bool fits = cluster <= kMaxCluster && (cluster == 1 || dev.cluster_launch) &&
                      resident_units<Op, T, VEC, kCtaNV, kPath, 0>(device, kMaxThreads, cluster,
                                                                   dev.sm_count) > 0;
    return fits ? cluster : 0;
  };
  using Stashed = std::integral_constant<RowPath, RowPath::kStashed>;
  using Registers = std::integral_constant<RowPath, RowPath::kCluster>;
  // 16-bit rows of ops without params stash (H100, 2^26 elements, ratio to a copy at
  // N = 32768 / 65536 / 131072 / 262144: bf16 softmax 0.88 / 0.87 / 0.83 / 0.77 without,
  // 0.98 / 0.90 / 0.90 / 0.88 with), and so do RMSNorm's: x stashed as itself (StashOf) takes
  // 32 KiB per CTA, beside which the CTA's weight (twice the columns, 64 KiB) stays cached
  // with two CTAs per SM (bf16, 0.911 / 0.899 / - / 0.895 -> 0.964 / 0.917 / - / 0.903; with
  // the weight read from global memory instead 0.89 / 0.77 / - / 0.75). LayerNorm's two params
  // do not fit beside the stash whole, and with part of them cached bf16 lost 2-23% (0.883 ->
  // 0.680 at 32768). fp32 rows of ops that read nothing but x (softmax_ and log_softmax_
  // without a mask; with one, two steps spilled 8-44 bytes) stash where that leaves at most
  // two CTAs a row: one sweep, ratio to a copy, N = 32768 / 65536 / 131072 / 262144: 0.955 /
  // 0.926 / 0.926 / 0.930 without, 0.974 / 0.948 / 0.923 / 0.916 with (fp32 softmax_;
  // log_softmax_ alike).
  constexpr bool kStash16 =
      sizeof(T) == 2 && (Op::kParams == 0 || (Op::kParams == 1 && Op::kKeepsX));
  constexpr bool kStash32 =
      sizeof(T) == 4 && Op::kParams == 0 && std::is_same_v<typename Op::template Aux<VEC>, NoAux>;
  if constexpr (kStash16 || kStash32) {
    if (vecs > cta_vecs) {
      const int cluster = cluster_for(Stashed{});
      if (cluster > 0 && (kStash16 || cluster <= 2))
        return launch_caching<Op, T, VEC, kCtaNV, RowPath::kStashed>(x, layout, op, cluster,
                                                                     device, dev.sm_count, stream);
    }
  }
  if (const int cluster = cluster_for(Registers{}))
    return launch_caching<Op, T, VEC, kCtaNV, RowPath::kCluster>(x, layout, op, cluster, device,
                                                                 dev.sm_count, stream);
  return launch_row_kernel<Op, T, VEC, kStreamRegs / VEC, RowPath::kStream>(
      x, layout, op, kMaxThreads, kMaxThreads, 1, device, dev.sm_count, stream);
}

}  // namespace mti
