// The steps of the forward kernel (forward.cuh): reading a step of a row into registers
// through the op, writing it back, caching the op's per-column params and stashing a step in
// shared memory.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/rowwise/framework.cuh"

namespace mti {

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

// Where read_vectors() gets x's vectors from: global memory.
template <int VEC, typename T>
struct GlobalVectors {
  const T* row;
  int64_t col_stride;
  template <typename Col>
  __device__ __forceinline__ Packed<T, VEC> operator()(int, Col c0) const {
    return load_vec<VEC>(row, c0, col_stride);
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

// Starts copying `param` (or writes its value where absent) at this thread's first `count`
// vectors that start before n into its slots: vector k to slots[k * stride]. Off the streaming
// path a thread owns the same columns of every row it handles, so a cached param is read from
// global memory once per CTA, not once per row: for a long row the params miss L1, and their
// loads held up the stores of the write loop. cp.async, so that the copies run alongside the
// first row's loads, and through L1 (.ca), which the CTAs of an SM that own the same columns
// share.
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

// Reads one step of NV vectors into z (x -> z via the op, kPad from `load_end` on) and returns
// the op's state of it. A vector is read if it starts before `load_end`; its elements from
// `load_end` on are replaced by kPad. kFull: every vector lies before `load_end` (<= `end`),
// so the accesses are unconditional and every element is a column of the row. All of x's
// loads are issued before any value is used; side inputs follow in batches of at most
// kAuxBatchBytes.
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
// too; lanes of causal rows (load_end at the row's limit) disagree in most warps. The vote
// costs a register, which the cluster kernels, at their limit, spill (fp32 softmax
// with a float mask on sm_86/sm_89); their causal rows are long runs of full steps anyway.
template <bool kPerWarp, int NV, int VEC, class Op, class Src, typename Col, int kStride>
__device__ __forceinline__ typename Op::State read_step(float (&z)[NV][VEC], const Op& op,
                                                        const Src& src, const typename Op::Row& rc,
                                                        const StepCursor<Col, kStride>& at,
                                                        Col load_end, Col end) {
  const bool full = at.col(NV - 1, VEC) + VEC <= load_end;
  if (kPerWarp ? warp_all(full) : full)
    return read_vectors<true>(z, op, src, rc, at, load_end, end);
  return read_vectors<false>(z, op, src, rc, at, load_end, end);
}

// Turns one step of z into outputs and stores the vectors that start before `end` (and so lie
// in the row whole). Each vector's params are read before the vector ahead of it is stored:
// read in turn, each param load stayed behind the previous vector's store, so every vector
// waited for its params. Not in 16-bit rows of up to kWarpRegs values per thread, whose
// kernels fit three CTAs per SM in 80 registers: there the read-ahead params spilled.
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

// RowPath::kStashed: each thread holds two steps of a row, the first in shared memory from
// its reduction to its write (stash_step), the second in registers. A CTA (cluster) then
// holds twice the row that registers alone do: half the cluster for the same row, so that a
// 16-bit CTA moves as many bytes per row as an fp32 one, and the cluster's fixed costs (its
// reduction, its packing onto the SMs) weigh half as much.
//
// A thread's z of one step in shared memory as S: element e of z (in the
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

// How many params a launch would cache: up to the last one given (not nullptr).
template <typename T, int K>
int params_to_cache(const ColumnParams<T, K>& params) {
  int count = 0;
  if constexpr (K > 0)
    for (int i = 0; i < K; ++i)
      if (params.ptr[i] != nullptr) count = i + 1;
  return count;
}

}  // namespace mti
