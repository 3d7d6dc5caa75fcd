// What the row-wise kernels share, forward (forward.cuh) and backward (backward_kernel.cuh):
// 16-byte vectors and their memory access, folds of a thread's values, the staging of a row
// into shared memory, and the launchers' host helpers (alignment, occupancy queries cached per
// device, launches on clusters). The reductions over the threads of a row are in reduce.cuh.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/row_layout.h"
#include "kernels/rowwise/paths.h"
#include "kernels/rowwise/reduce.cuh"
#include "kernels/rowwise/tuning.h"

namespace mti {

// Elements of T per 16-byte access.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// N elements of T that move as one access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

// Folds get(0), ..., get(COUNT - 1) with the associative `op` into up to 8 independent
// partials, then folds those pairwise: a chain of COUNT dependent operations would leave the
// warp waiting on each one's latency. COUNT (NV * VEC) is a power of two or at least 8.
template <int COUNT, class Get, class Op>
__device__ __forceinline__ float fold(Get get, Op op) {
  constexpr int kPartials = COUNT < 8 ? COUNT : 8;
  static_assert(COUNT > 0 && (kPartials & (kPartials - 1)) == 0,
                "COUNT must be a power of two or at least 8");
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

// A thread's staged vectors (stage_step: the backward kernel's staging): vector k of its
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

// ---------------------------------------------------------------------------- host side

inline int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

inline int64_t round_up(int64_t v, int64_t m) { return ceil_div(v, m) * m; }

// The most CTAs of a cluster that holds a row on this device (1 without clusters).
inline int max_cluster(const DeviceInfo& dev, const TuningKey& key) {
  return dev.cluster_launch
             ? static_cast<int>(std::min<int64_t>(kMaxCluster, tuned(kTunedMaxCluster, key)))
             : 1;
}

// occupancy_units() of kKernel with `smem` bytes of dynamic shared memory, asked once per
// device, CTA size (a multiple of kWarpSize, at most kMaxCta) and cluster size.
template <auto kKernel, int kMaxCta = kMaxThreads>
int resident_units(int device, int threads, int cluster, size_t smem, int sm_count) {
  static std::atomic<int> cache[kMaxCta / kWarpSize + 1][kMaxCluster + 1][kMaxDevices];
  return once_per_device(cache[threads / kWarpSize][cluster], device, [&](int) {
    return occupancy_units(kKernel, threads, cluster, smem, sm_count);
  });
}

// Launches `kernel` on `ctas` CTAs of `threads` threads with `smem` bytes of dynamic shared
// memory, in clusters of `cluster` CTAs where cluster > 1, and returns the launch's error. A
// launch past 48 KiB of dynamic shared memory or past clusters of 8 must follow a call of
// resident_units() for its shape, which lifts the kernel's limit and allows the cluster size.
template <class... Params, class... Args>
cudaError_t launch_clustered(void (*kernel)(Params...), int64_t ctas, int threads, size_t smem,
                             int cluster, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute dims = cluster_dims(cluster);
  config.attrs = &dims;
  config.numAttrs = cluster > 1 ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace mti
