// All-reductions of per-thread partial states over the threads that share one row: a group of
// lanes inside a warp, a whole CTA, or a cluster of CTAs linked by distributed shared memory
// (sm_90+). Shared by the row-wise kernels through rowwise/framework.cuh.
//
// A reduction state S is a trivially constructible struct of floats providing
//   static S identity();
//   static S combine(const S& a, const S& b);
//   template <class F> S map(F f) const;   // f applied to every field
// combine must give bitwise the same result for (a, b) and (b, a). The xor butterfly below
// pairs every lane with a partner that combines the same two states in the other order, so
// commutativity is what leaves identical bits in every lane, and with them identical row
// statistics in every thread that writes part of the row.
#pragma once

#include <cooperative_groups.h>

#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/rowwise/tuning.h"

namespace mti {

// Reduces over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp
// must call it, and every lane ends with its group's total. Each member of the state travels
// in its own type (a state of doubles is not rounded to float on the way). The steps are
// unrolled, each skipped past the width: a loop over a width known only at run time cost
// twice the instructions of its shuffles and adds.
template <class S>
__device__ __forceinline__ S warp_allreduce(S s, int width) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    if (offset < width) {
      const S other = s.map([offset](auto v) { return __shfl_xor_sync(0xffffffffu, v, offset); });
      s = S::combine(s, other);
    }
  }
  return s;
}

// A sum, two sums and a max as reduction states: _rn adds and fmaxf are commutative bitwise.
struct Sum {
  float v;
  static __device__ __forceinline__ Sum identity() { return {0.f}; }
  static __device__ __forceinline__ Sum combine(const Sum& x, const Sum& y) {
    return {__fadd_rn(x.v, y.v)};
  }
  template <class F>
  __device__ __forceinline__ Sum map(F f) const {
    return {f(v)};
  }
};

template <typename A>
struct Sum2 {
  A a, b;
  static __device__ __forceinline__ Sum2 identity() { return {A(0), A(0)}; }
  static __device__ __forceinline__ Sum2 combine(const Sum2& x, const Sum2& y) {
    if constexpr (std::is_same_v<A, double>)
      return {__dadd_rn(x.a, y.a), __dadd_rn(x.b, y.b)};
    else
      return {__fadd_rn(x.a, y.a), __fadd_rn(x.b, y.b)};
  }
  template <class F>
  __device__ __forceinline__ Sum2 map(F f) const {
    return {f(a), f(b)};
  }
};

struct MaxState {
  float v;
  static __device__ __forceinline__ MaxState identity() { return {-INFINITY}; }
  static __device__ __forceinline__ MaxState combine(const MaxState& x, const MaxState& y) {
    return {fmaxf(x.v, y.v)};
  }
  template <class F>
  __device__ __forceinline__ MaxState map(F f) const {
    return {f(v)};
  }
};

// The states of R rows reduced together: one pass through each level (shuffles, barrier,
// cluster exchange) serves all R.
template <class S, int R>
struct RowStates {
  S s[R];
  static __device__ __forceinline__ RowStates identity() {
    RowStates x;
#pragma unroll
    for (int i = 0; i < R; ++i) x.s[i] = S::identity();
    return x;
  }
  static __device__ __forceinline__ RowStates combine(const RowStates& x, const RowStates& y) {
    RowStates z;
#pragma unroll
    for (int i = 0; i < R; ++i) z.s[i] = S::combine(x.s[i], y.s[i]);
    return z;
  }
  template <class F>
  __device__ __forceinline__ RowStates map(F f) const {
    RowStates z;
#pragma unroll
    for (int i = 0; i < R; ++i) z.s[i] = s[i].map(f);
    return z;
  }
};

template <class S, class = void>
struct HasChunkAllreduce : std::false_type {};
template <class S>
struct HasChunkAllreduce<S, std::void_t<decltype(S::allreduce_chunks(std::declval<const S&>(), 0))>>
    : std::true_type {};

// warp_allreduce of the states of the threads' own chunks of a row, where a state may bring
// an all-reduction of its own for that first level (S::allreduce_chunks(s, width), with
// warp_allreduce's contract), one that may rely on each chunk holding few values: the
// forward kernel calls it for chunks held in registers only (rowwise/forward.cuh).
template <class S>
__device__ __forceinline__ S warp_allreduce_chunks(const S& s, int width) {
  if constexpr (HasChunkAllreduce<S>::value)
    return S::allreduce_chunks(s, width);
  else
    return warp_allreduce(s, width);
}

// Whether `p` holds in every lane of the warp, to pick one of several paths that are all
// correct and differ only in speed: lanes that disagreed would run each path they took one
// after the other. The vote is over the active lanes (__activemask), so it needs no lane to be
// anywhere in particular.
__device__ __forceinline__ bool warp_all(bool p) { return __all_sync(__activemask(), p); }

// Reduces the per-warp totals of the rows of a CTA, each row held by `row_warps` consecutive
// warps from `first_warp` on (by default the whole CTA holds one row); every thread must call
// it with its warp's total and gets its row's total. `buf` (kWarps states, kWarps >= the CTA's
// warps, a power of two) must not be in use by the previous call: callers alternate two
// buffers, and the __syncthreads of the previous call on the other buffer orders each read of
// this one before its next overwrite. The totals are folded by a butterfly in every aligned
// group of kWarps lanes (a group's lane i takes the row's warp i's total, or the identity past
// its last warp), log2(kWarps) combines deep instead of a chain of one per warp; identity is
// exact under combine, and the butterfly leaves the same bits in every lane (see
// warp_allreduce).
template <int kWarps = kMaxWarps, class S>
__device__ __forceinline__ S cta_allreduce(const S& warp_total, S* buf, int first_warp = 0,
                                           int row_warps = blockDim.x / kWarpSize) {
  static_assert(kWarps <= kWarpSize && (kWarps & (kWarps - 1)) == 0, "a butterfly of lanes");
  if (threadIdx.x % kWarpSize == 0) buf[threadIdx.x / kWarpSize] = warp_total;
  __syncthreads();
  const int w = static_cast<int>(threadIdx.x) % kWarps;
  return warp_allreduce(w < row_warps ? buf[first_warp + w] : S::identity(), kWarps);
}

// Full cluster barrier with release/acquire semantics. Its release costs a GPU-scope fence
// (MEMBAR.ALL.GPU, which waits for the thread's outstanding global stores), so it is used only
// at kernel start (every CTA must have started, and initialized its mbarriers, before another
// writes to its shared memory) and end; per-row exchanges go through mbarriers instead.
__device__ __forceinline__ void cluster_sync() {
#if MTI_MBARRIER  // sm_90+: clusters too
  cooperative_groups::this_cluster().sync();
#else
  __trap();  // the launchers use clusters only for kernels compiled for sm_90+
#endif
}

// Shared memory of the cluster reduction, double-buffered by row parity: CTA `rank` writes its
// total into slots[p][rank] of every CTA of the cluster with st.async, whose completion
// counts bytes down on the receiving CTA's mbarrier full[p]; a CTA's phase of full[p]
// completes once all `cluster` totals have landed, and the data is then visible to the
// threads that waited on it. No CTA can write a buffer twice before its owner has read it:
// to reach row r + 2, a CTA must have received everyone's row r + 1 totals, and each CTA
// sends those only after all its threads have read their row r totals (a __syncthreads of
// the CTA reduction lies in between).
template <class S>
struct ClusterExchange {
  S slots[2][kMaxCluster];
  uint64_t full[2];
};

// Called by every thread once before the first exchange, followed by cluster_sync().
template <class S>
__device__ __forceinline__ void cluster_exchange_init(ClusterExchange<S>& ex) {
#if MTI_MBARRIER  // sm_90+: clusters too
  if (threadIdx.x == 0) {
    for (int p = 0; p < 2; ++p) mbar_init(smem_u32(&ex.full[p]), 1);
    mbar_init_fence();
  }
#else
  __trap();
#endif
}

// Reduces the CTA totals of a cluster that works on a single row; every thread of every CTA
// calls it with its CTA's total and gets the cluster total. `use` counts the calls so far: it
// picks the buffer (use % 2) and the mbarrier phase to wait for (use / 2 % 2). The totals are
// folded by a butterfly in every aligned group of `width` lanes, the cluster size rounded up
// to a power of two (lane i takes rank i % width's total, or the identity past the last
// rank), log2(width) combines deep, which leaves the same bits in every lane of every CTA
// (see cta_allreduce), where a chain of combines in rank order would be as deep as the cluster
// is wide (softmax's combine runs an exp).
template <class S>
__device__ __forceinline__ S cluster_allreduce(const S& cta_total, ClusterExchange<S>& ex,
                                               unsigned use, int rank, int cluster) {
#if MTI_MBARRIER  // sm_90+: clusters too
  constexpr int kWords = sizeof(S) / sizeof(float);
  static_assert(sizeof(S) == kWords * sizeof(float), "a state is a struct of floats");
  const unsigned p = use % 2;
  const uint32_t full = smem_u32(&ex.full[p]);
  if (threadIdx.x == 0) mbar_arrive_expect_tx(full, static_cast<uint32_t>(cluster * sizeof(S)));
  if (static_cast<int>(threadIdx.x) < cluster) {
    const uint32_t slot = map_to_rank(smem_u32(&ex.slots[p][rank]), threadIdx.x);
    const uint32_t remote_full = map_to_rank(full, threadIdx.x);
    float words[kWords];
    memcpy(words, &cta_total, sizeof(S));
#pragma unroll
    for (int i = 0; i < kWords; ++i)
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(slot +
                                                                                            i * 4u),
          "r"(__float_as_uint(words[i])), "r"(remote_full)
          : "memory");
  }
  mbar_wait(full, (use / 2) % 2);
  int width = 1;
  while (width < cluster) width *= 2;
  const int r = static_cast<int>(threadIdx.x) % width;
  return warp_allreduce(r < cluster ? ex.slots[p][r] : S::identity(), width);
#else
  __trap();
  return cta_total;
#endif
}

}  // namespace mti
