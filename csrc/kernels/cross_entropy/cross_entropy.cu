// cross_entropy_ on CUDA (declared in cross_entropy.h). A small kernel first checks and counts
// the targets; then one CTA per row (grid-stride over rows) reads the row once for its max,
// sum of exps (online: the sum is rescaled when the max grows, once per vector) and, with label
// smoothing, sum of logits, reduces them over the CTA, and reads the row again to write the
// gradient over it, 16 bytes per access wherever the row's alignment allows. No memory beyond
// the counter. A row is at most a few hundred KiB (128256 bf16: 256 KiB), so its second read
// may come from L2.
#include <cuda_runtime.h>

#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/cross_entropy/cross_entropy.h"

namespace mti {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTargetThreads = 256;
constexpr int64_t kMaxTargetCtas = 1024;
// Enough CTAs to fill any GPU many times over; each walks rows grid-stride.
constexpr int64_t kMaxRowCtas = 1 << 16;

// exp for the row statistics, whose loss is float32 (float64): accurate expf (exp), never
// __expf, whose error grows with |x| and would show in the loss.
template <typename T>
__device__ __forceinline__ cross_entropy_acc_t<T> stat_exp(cross_entropy_acc_t<T> x) {
  if constexpr (std::is_same_v<T, double>)
    return exp(x);
  else
    return exp_for<float>(x);
}

// exp for the gradient, rounded to T: exp_for<T> (__expf for 16-bit T, where the rounding
// hides its error).
template <typename T>
__device__ __forceinline__ cross_entropy_acc_t<T> grad_exp(cross_entropy_acc_t<T> x) {
  if constexpr (std::is_same_v<T, double>)
    return exp(x);
  else
    return exp_for<T>(x);
}

__global__ void __launch_bounds__(kTargetThreads)
    count_targets_kernel(const int64_t* target, int64_t rows, int64_t n, int64_t ignore_index,
                         unsigned long long* valid_rows) {
  unsigned long long valid = 0;
  for (int64_t r = blockIdx.x * int64_t{kTargetThreads} + threadIdx.x; r < rows;
       r += int64_t{gridDim.x} * kTargetThreads) {
    const int64_t t = target[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= n) {
      printf(
          "cross_entropy_: target %lld (row %lld) is out of bounds for %lld classes and is not "
          "ignore_index (%lld)\n",
          static_cast<long long>(t), static_cast<long long>(r), static_cast<long long>(n),
          static_cast<long long>(ignore_index));
      // Fires in builds with NDEBUG too, as PyTorch's CUDA_KERNEL_ASSERT does.
      __assert_fail("cross_entropy_: target out of bounds", __FILE__, __LINE__, __func__);
    }
    ++valid;
  }
  for (int o = 16; o > 0; o >>= 1) valid += __shfl_xor_sync(0xffffffffu, valid, o);
  if (threadIdx.x % 32 == 0 && valid != 0) atomicAdd(valid_rows, valid);
}

// A thread's (or a group's) running statistics of a row: max, sum of exp(x - max), sum of x.
template <typename A>
struct RowStats {
  A max, sum_exp, sum_x;
};

template <typename T, typename A>
__device__ __forceinline__ RowStats<A> merge(const RowStats<A>& a, const RowStats<A>& b) {
  const A m = a.max > b.max ? a.max : b.max;
  // Both still empty (or all -inf): exp(-inf - -inf) would be NaN.
  if (m == -static_cast<A>(INFINITY)) return {m, A(0), a.sum_x + b.sum_x};
  return {m, a.sum_exp * stat_exp<T>(a.max - m) + b.sum_exp * stat_exp<T>(b.max - m),
          a.sum_x + b.sum_x};
}

// Folds `count` values into s: one rescale of the running sum for all of them.
template <typename T, typename A, int kCount>
__device__ __forceinline__ void fold(RowStats<A>& s, const A (&v)[kCount]) {
  A m = s.max;
#pragma unroll
  for (int i = 0; i < kCount; ++i) m = v[i] > m ? v[i] : m;
  if (m == -static_cast<A>(INFINITY)) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) s.sum_x += v[i];
    return;
  }
  A e = s.sum_exp * stat_exp<T>(s.max - m);
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    e += stat_exp<T>(v[i] - m);
    s.sum_x += v[i];
  }
  s.max = m;
  s.sum_exp = e;
}

// The row's statistics, in every thread. `scratch`: kWarps entries of shared memory, free for
// reuse once this returns.
template <typename T, typename A>
__device__ RowStats<A> block_merge(RowStats<A> s, RowStats<A>* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    const RowStats<A> other = {__shfl_xor_sync(0xffffffffu, s.max, o),
                               __shfl_xor_sync(0xffffffffu, s.sum_exp, o),
                               __shfl_xor_sync(0xffffffffu, s.sum_x, o)};
    s = merge<T>(s, other);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = s;
  __syncthreads();
  RowStats<A> r = scratch[0];
  for (int w = 1; w < kWarps; ++w) r = merge<T>(r, scratch[w]);
  __syncthreads();
  return r;
}

// A row of n elements walked by the CTA: the elements before its first 16-byte aligned address
// one at a time, then whole 16-byte vectors, then the rest one at a time. each(f) calls
// f(j, vals) with vals an array of kVec values (or of one) starting at element j; f returns
// whether to store vals back. A thread visits the same elements in every walk of a row.
template <typename T>
struct RowAccess {
  static constexpr int kVec = 16 / sizeof(T);
  struct alignas(16) Vec {
    T v[kVec];
  };
  T* row;
  int64_t n, head, body_end;  // [0, head) singly, [head, body_end) in vectors, then singly

  __device__ RowAccess(T* r, int64_t n_) : row(r), n(n_) {
    const auto addr = reinterpret_cast<uintptr_t>(r);
    const int64_t misaligned = static_cast<int64_t>((16 - addr % 16) % 16);
    const int64_t to_aligned = misaligned / static_cast<int64_t>(sizeof(T));
    head = addr % sizeof(T) != 0 || to_aligned > n ? n : to_aligned;
    body_end = head + (n - head) / kVec * kVec;
  }

  template <class F>
  __device__ __forceinline__ void each(F f) const {
    for (int64_t j = threadIdx.x; j < head; j += kThreads) single(j, f);
    for (int64_t j = head + int64_t{threadIdx.x} * kVec; j < body_end;
         j += int64_t{kThreads} * kVec) {
      Vec vec = *reinterpret_cast<const Vec*>(row + j);
      if (f(j, vec.v)) *reinterpret_cast<Vec*>(row + j) = vec;
    }
    for (int64_t j = body_end + threadIdx.x; j < n; j += kThreads) single(j, f);
  }

 private:
  template <class F>
  __device__ __forceinline__ void single(int64_t j, F& f) const {
    T one[1] = {row[j]};
    if (f(j, one)) row[j] = one[0];
  }
};

// CTAs resident per SM that ptxas must allow for. Float types: 4 (at most 64 registers; the
// accurate expf of the statistics pass took 72 without a bound): half an sm_80/sm_90 SM's
// threads, and about 500 rows in flight, whose second read (a 32000-word bf16 row: 64 KiB)
// can then still come from L2. Not measured yet; candidates for a tuning table. float64: 1,
// else ptxas held it to 64 registers and spilled around the row offset's 64-bit divisions.
template <typename T>
constexpr int kMinCtasPerSm = std::is_same_v<T, double> ? 1 : 4;

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<T>)
    cross_entropy_kernel(T* logits, const RowLayout layout, const int64_t* target,
                         const CrossEntropyParams p, cross_entropy_acc_t<T>* losses,
                         const unsigned long long* valid_rows) {
  using A = cross_entropy_acc_t<T>;
  __shared__ RowStats<A> scratch[kWarps];
  const int64_t n = layout.n;
  const A scale =
      p.reduction == CrossEntropyReduction::kMean ? A(1) / static_cast<A>(*valid_rows) : A(1);
  const A eps = static_cast<A>(p.label_smoothing);
  const A off_target = static_cast<A>(p.label_smoothing / static_cast<double>(n));
  const A on_target = (A(1) - eps) + off_target;
  for (int64_t r = blockIdx.x; r < layout.rows; r += gridDim.x) {
    const RowAccess<T> row(logits + layout.row.offset(r), n);
    const int64_t t = target[r];
    if (t == p.ignore_index) {
      row.each([](int64_t, auto& v) {
        for (auto& e : v) e = from_acc<T>(A(0));
        return true;
      });
      // 0 / 0 = NaN where every row is ignored: the mean of no losses, as in PyTorch.
      if (threadIdx.x == 0) losses[r] = A(0) * scale;
      continue;
    }
    // Read before any thread of the CTA writes the row (block_merge synchronises); only
    // thread 0 needs it.
    const A x_target = threadIdx.x == 0 ? to_acc(row.row[t]) : A(0);
    RowStats<A> s = {-static_cast<A>(INFINITY), A(0), A(0)};
    row.each([&](int64_t, auto& v) {
      constexpr int k = std::extent_v<std::remove_reference_t<decltype(v)>>;
      A a[k];
#pragma unroll
      for (int i = 0; i < k; ++i) a[i] = to_acc(v[i]);
      fold<T>(s, a);
      return false;
    });
    s = block_merge<T>(s, scratch);
    const A inv = A(1) / s.sum_exp;
    if (threadIdx.x == 0) {
      // log_softmax's order, (max - x) + log(sum): max - x is exact where x is near the max,
      // and nothing large is added to then cancel.
      const A log_sum = log(s.sum_exp);
      // eps == 0 drops the smoothing term whatever sum_x is (an infinite logit makes it NaN).
      const A smooth = eps > A(0) ? eps * ((s.max - s.sum_x / static_cast<A>(n)) + log_sum) : A(0);
      losses[r] = ((A(1) - eps) * ((s.max - x_target) + log_sum) + smooth) * scale;
    }
    row.each([&](int64_t j, auto& v) {
      constexpr int k = std::extent_v<std::remove_reference_t<decltype(v)>>;
#pragma unroll
      for (int i = 0; i < k; ++i) {
        const A prob = grad_exp<T>(to_acc(v[i]) - s.max) * inv;
        v[i] = from_acc<T>((prob - (j + i == t ? on_target : off_target)) * scale);
      }
      return true;
    });
  }
}

}  // namespace

template <typename T>
cudaError_t launch_cross_entropy(T* logits, const RowLayout& layout, const int64_t* target,
                                 const CrossEntropyParams& params, cross_entropy_acc_t<T>* losses,
                                 unsigned long long* valid_rows, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(valid_rows, 0, sizeof(*valid_rows), stream);
  if (err != cudaSuccess || layout.rows == 0) return err;
  const int64_t target_ctas =
      std::min(kMaxTargetCtas, ceil_div(layout.rows, int64_t{kTargetThreads}));
  count_targets_kernel<<<static_cast<unsigned>(target_ctas), kTargetThreads, 0, stream>>>(
      target, layout.rows, layout.n, params.ignore_index, valid_rows);
  const int64_t ctas = std::min(kMaxRowCtas, layout.rows);
  cross_entropy_kernel<T><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
      logits, layout, target, params, losses, valid_rows);
  return cudaGetLastError();
}

#define MTI_INSTANTIATE(T)                                                                         \
  template cudaError_t launch_cross_entropy<T>(T*, const RowLayout&, const int64_t*,               \
                                               const CrossEntropyParams&, cross_entropy_acc_t<T>*, \
                                               unsigned long long*, cudaStream_t);
MTI_FOR_EACH_DTYPE(MTI_INSTANTIATE)
#undef MTI_INSTANTIATE

}  // namespace mti
