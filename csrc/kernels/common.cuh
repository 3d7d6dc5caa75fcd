// Small helpers shared by every kernel in csrc/kernels/ (no torch here): device code, and the
// launchers' host helpers (the cluster attribute, per-device answers, the device's
// properties, occupancy).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <utility>

#include "kernels/tuning.h"

namespace mti {

// Conversions between the storage types and the fp32 the kernels accumulate in.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Applies M to each dtype that the kernels taking float64 too are built for (their explicit
// instantiations).
#define MTI_FOR_EACH_DTYPE(M) M(float) M(__half) M(__nv_bfloat16) M(double)

// The type a kernel that takes float64 too computes in: double for double, float otherwise.
template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ __forceinline__ acc_type_t<T> to_acc(T v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return to_float(v);
}

template <typename T>
__device__ __forceinline__ T from_acc(acc_type_t<T> v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return from_float<T>(v);
}

// exp as accurate as the output type needs: __expf's relative error grows with |x| (about
// |x| * 2^-22), invisible once rounded to bf16/fp16 but several times PyTorch's error in fp32,
// where the accurate expf is used.
template <typename T>
__device__ __forceinline__ float exp_for(float x) {
  return __expf(x);
}
template <>
__device__ __forceinline__ float exp_for<float>(float x) {
  return expf(x);
}

// 2^x on the special function unit: one MUFU.EX2, which flushes results below 2^-126 to zero.
// __expf(x) is the non-ftz ex2.approx.f32 of x * kLog2e (the product rounded to nearest),
// which adds a compare and two predicated multiplies per call to return subnormal results
// (2^(x/2) squared where x < -126); for x >= -126 (and NaN) it runs the same MUFU.EX2 on the
// same argument, so ex2_ftz(x * kLog2e) and __expf(x) agree bit for bit there.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950216293334961f;

// Whether no exp of an argument >= `smallest` is subnormal, so that ex2_ftz(x * kLog2e) has
// __expf(x)'s bits for each of them: x * kLog2e rounds monotonically in x, so the smallest
// argument tells.
__device__ __forceinline__ bool no_subnormal_exps(float smallest) {
  return smallest * kLog2e >= -126.f;
}

// Calls f with an exp that has exp_for<T>'s bits (T 16-bit: __expf's) for every argument x
// the caller passes it: one MUFU.EX2 each (ex2_ftz(x * kLog2e)) where `no_subnormals`
// (no_subnormal_exps of the smallest x) holds, else exp_for<T> itself, which pays three
// instructions more per call for the subnormal results (see ex2_ftz). Callers that find the
// smallest argument for one min per element thus save two instructions per exp.
template <typename T, class F>
__device__ __forceinline__ decltype(auto) with_exp_for(bool no_subnormals, F f) {
  static_assert(sizeof(T) == 2, "exp_for<T> is __expf");
  if (no_subnormals) return f([](float x) { return ex2_ftz(x * kLog2e); });
  return f([](float x) { return exp_for<T>(x); });
}

// 1 / x on the special function unit: one MUFU.RCP, within 1 ulp, subnormal x flushed to zero
// (1 / x is inf there). __frcp_rn adds a Newton step and a slow-path branch to round
// correctly: for kernels whose outputs are 16-bit, a per-element cost with no visible effect.
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// cp.async (sm_80+): global -> shared copies that complete in the background, tracked per
// thread in commit groups. Older architectures copy synchronously instead.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zeros instead when !in (src must still be a valid address).
// kKeepInL1: the data also goes into L1 (cp.async.ca), for data that the other CTAs on the SM
// read too; else only L2 holds it (.cg), for data read once.
template <bool kKeepInL1 = false>
__device__ __forceinline__ void copy16(void* dst, const void* src, bool in) {
#if __CUDA_ARCH__ >= 800
  if constexpr (kKeepInL1)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(in ? 16 : 0)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(in ? 16 : 0)
                 : "memory");
#else
  *reinterpret_cast<uint4*>(dst) =
      in ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// *p, its cache line kept in L2 ahead of the streamed rows (marked evict-last by a prefetch of
// the same address just before, sm_80+): for data that many rows read again, such as a mask
// broadcast over the batch, which a batch's own rows (read and written once) would otherwise
// flush from L2 before the next batch reads it. (A load with an evict-last cache policy
// instead holds the policy in two registers, which spilled the largest masked kernels on sm_80
// and sm_90a.)
template <typename V>
__device__ __forceinline__ V load_keep_in_l2(const V* p) {
#if __CUDA_ARCH__ >= 800
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
#endif
  return *p;
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The launch attribute that groups a 1-D grid into clusters of `cluster` CTAs (sm_90+).
inline cudaLaunchAttribute cluster_dims(int cluster) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// The host-side launchers' answers per device: questions about a device (its occupancy for a
// kernel, whether a kernel has some code) whose answers cannot change while the process runs.
constexpr int kMaxDevices = 64;  // devices whose answers are kept

// f(device), an int >= 0, asked once per device: `cache` holds answer + 1 per device, 0 where
// not asked yet (devices past kMaxDevices are asked every time). A failed query's error is
// its answer, not the caller's, so it is cleared.
template <class F>
int once_per_device(std::atomic<int> (&cache)[kMaxDevices], int device, F&& f) {
  std::atomic<int>* slot = device < kMaxDevices ? &cache[device] : nullptr;
  const int known = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
  if (known != 0) return known - 1;
  const int answer = f(device);
  cudaGetLastError();
  if (slot != nullptr) slot->store(answer + 1, std::memory_order_relaxed);
  return answer;
}

// The same for the current device; 0 where it cannot be told.
template <class F>
int once_per_device(std::atomic<int> (&cache)[kMaxDevices], F&& f) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return once_per_device(cache, device, std::forward<F>(f));
}

// What the launchers ask of a device, which cannot change while the process runs.
struct DeviceInfo {
  int cc = 0;  // compute capability, 10 * major + minor
  int sm_count = 0;
  int threads_per_sm = 0;
  int smem_optin = 0;           // bytes of shared memory a CTA may opt into
  int smem_per_sm = 0;          // bytes of shared memory of a multiprocessor
  int smem_reserved = 0;        // bytes the system reserves per CTA
  bool coop = false;            // cooperative launches
  bool cluster_launch = false;  // thread-block clusters (sm_90+)
  int mem_gbps = 0;             // peak memory bandwidth, GB/s (2 transfers per memory clock)
};

// The GPU half of a tuning table's key (kernels/tuning.h), with the call's half.
inline TuningKey tuning_key(const DeviceInfo& d, int elem_bytes, int64_t n) {
  return TuningKey{d.cc, d.sm_count, d.mem_gbps, d.smem_optin, elem_bytes, n};
}

// The current device (*device) and its DeviceInfo, queried once per device (its attribute
// queries took a good part of a small call's host time): queried where not yet known,
// published under a lock, read without one once published.
inline cudaError_t current_device(int* device, DeviceInfo* info) {
  static DeviceInfo known[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  static std::mutex mutex;
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  const int dev = *device;
  const bool cached = dev < kMaxDevices;
  if (cached && ready[dev].load(std::memory_order_acquire)) {
    *info = known[dev];
    return cudaSuccess;
  }
  int major = 0, minor = 0, coop = 0, clusters = 0, mem_khz = 0, bus_bits = 0;
  const std::pair<int*, cudaDeviceAttr> attrs[] = {
      {&major, cudaDevAttrComputeCapabilityMajor},
      {&minor, cudaDevAttrComputeCapabilityMinor},
      {&info->sm_count, cudaDevAttrMultiProcessorCount},
      {&info->threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor},
      {&info->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
      {&info->smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor},
      {&info->smem_reserved, cudaDevAttrReservedSharedMemoryPerBlock},
      {&coop, cudaDevAttrCooperativeLaunch},
      {&clusters, cudaDevAttrClusterLaunch},
      {&mem_khz, cudaDevAttrMemoryClockRate},
      {&bus_bits, cudaDevAttrGlobalMemoryBusWidth},
  };
  for (const auto& [value, attr] : attrs)
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(value, attr, dev);
  if (err != cudaSuccess) return err;
  info->cc = 10 * major + minor;
  info->coop = coop != 0;
  info->cluster_launch = clusters != 0;
  info->mem_gbps = static_cast<int>(2 * int64_t{mem_khz} * (bus_bits / 8) / 1000000);
  if (cached) {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!ready[dev].load(std::memory_order_relaxed)) {
      known[dev] = *info;
      ready[dev].store(true, std::memory_order_release);
    }
  }
  return cudaSuccess;
}

// The same, for callers that need no device index.
inline cudaError_t current_device(DeviceInfo* info) {
  int device = 0;
  return current_device(&device, info);
}

// How many CTAs (clusters of `cluster` CTAs when cluster > 1) of `threads` threads with
// `smem` bytes of dynamic shared memory of `kernel` can be resident on the current device at
// once; 0 if none can. Clusters need the kernel compiled for sm_90+ (a build without sm_90
// code runs older machine code on an H100, and that code has no cluster reduction). Also
// lifts the kernel's dynamic shared memory limit past the default 48 KiB where needed. A
// failed query counts as "none" and its error is cleared so that it does not surface as a
// launch error. Not cached: callers cache per device and launch shape (once_per_device).
// The limit is only ever raised (under a lock, so that two host threads cannot lower it
// either): a kernel launched with several sizes of shared memory (backward_kernel with CTAs
// of 288-512 threads) must keep the largest that a cached launch shape needs (lowered, a
// later launch of that shape failed with "invalid argument"). smem_limit: the limit to lift
// it to where larger than smem; cooperative: ask for a cooperative launch.
template <class Kernel>
int occupancy_units(Kernel kernel, int threads, int cluster, size_t smem, int sm_count,
                    size_t smem_limit = 0, bool cooperative = false) {
  static std::mutex raising;
  int units = 0;
  cudaFuncAttributes attr;
  const size_t limit = std::max(smem, smem_limit);
  bool ok;
  {
    const std::lock_guard<std::mutex> lock(raising);
    ok = cudaFuncGetAttributes(&attr, kernel) == cudaSuccess &&
         (limit <= static_cast<size_t>(attr.maxDynamicSharedSizeBytes) ||
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(limit)) == cudaSuccess);
  }
  if (ok && cluster == 1) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) ==
        cudaSuccess)
      units = per_sm * sm_count;
  } else if (ok && attr.ptxVersion >= 90 &&
             (cluster <= 8 ||
              cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
                  cudaSuccess)) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(cluster);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute attrs[2] = {cluster_dims(cluster)};
    attrs[1].id = cudaLaunchAttributeCooperative;
    attrs[1].val.cooperative = 1;
    config.attrs = attrs;
    config.numAttrs = cooperative ? 2 : 1;
    if (cudaOccupancyMaxActiveClusters(&units, kernel, &config) != cudaSuccess) units = 0;
  }
  cudaGetLastError();
  return units;
}

}  // namespace mti
