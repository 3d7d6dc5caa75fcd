// rope_ on CUDA (declared in rope.h). Purely bandwidth bound: each element of x is read and
// written once, cos and sin are read once per row that uses them (re-read across heads, from
// L1 or L2). A row is split between up to a warp of threads, each taking one 16-byte chunk of
// x1 and the chunk of x2 at the same column (and the same chunks of cos and sin), so it holds
// everything its outputs need and writes them over what it read; a thread keeps
// kRopeRowsPerThread rows in flight. Rows whose starts or half are not 16-byte aligned take the
// same kernel one element per chunk. The grid is the CTAs resident on the GPU at once, striding
// over groups of rows.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/rope/rope.h"
#include "kernels/rope/tuning.h"

namespace mti {
namespace {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Chunk {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> load_chunk(const T* p) {
  return *reinterpret_cast<const Chunk<T, VEC>*>(p);
}

template <typename A>
__device__ __forceinline__ A fma_acc(A a, A b, A c) {
  if constexpr (std::is_same_v<A, double>)
    return ::fma(a, b, c);
  else
    return fmaf(a, b, c);
}

// A chunk of cos or sin: kept in L2 ahead of the streamed rows where other rows read it again.
template <bool kKeepInL2, typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> load_table(const T* p) {
  if constexpr (kKeepInL2)
    return load_keep_in_l2(reinterpret_cast<const Chunk<T, VEC>*>(p));
  else
    return load_chunk<T, VEC>(p);
}

// VEC: elements per chunk (16 bytes, or 1 where rows are not aligned for that). tpr_log2: log2
// of the threads that share a row. backward: the transpose, which is the forward with
// (s1, s2) replaced by (-s2, -s1): sin's halves read swapped and negated.
template <typename T, int VEC, bool kKeepTables>
__global__ void __launch_bounds__(kRopeThreads, kRopeMinCtasPerSm)
    rope_kernel(const T* in, T* out, const T* __restrict__ cos, const T* __restrict__ sin,
                const RopeLayout L, int tpr_log2, bool backward) {
  using A = acc_type_t<T>;
  constexpr int K = kRopeRowsPerThread;
  const int64_t half = L.half;
  const int64_t chunks = half / VEC;
  const int64_t lane = threadIdx.x & ((1 << tpr_log2) - 1);
  const int64_t rows_per_step = kRopeThreads >> tpr_log2;
  const int64_t rows_per_group = rows_per_step * K;
  const int64_t s_first = backward ? half : 0, s_second = backward ? 0 : half;
  const A sign = backward ? A(-1) : A(1);
  for (int64_t group = int64_t{blockIdx.x} * rows_per_group; group < L.rows;
       group += int64_t{gridDim.x} * rows_per_group) {
    int64_t off_in[K], off_out[K], off_cos[K], off_sin[K];
    bool valid[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t r = group + (threadIdx.x >> tpr_log2) + k * rows_per_step;
      valid[k] = r < L.rows;
      if (!valid[k]) continue;
      off_in[k] = L.in.offset(r);
      off_out[k] = L.out_is_in ? off_in[k] : L.out.offset(r);
      off_cos[k] = L.cos.offset(r);
      off_sin[k] = L.sin.offset(r);
    }
    for (int64_t c = lane; c < chunks; c += int64_t{1} << tpr_log2) {
      const int64_t j = c * VEC;
      Chunk<T, VEC> x1[K], x2[K], c1[K], c2[K], s1[K], s2[K];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!valid[k]) continue;
        x1[k] = load_chunk<T, VEC>(in + off_in[k] + j);
        x2[k] = load_chunk<T, VEC>(in + off_in[k] + half + j);
        c1[k] = load_table<kKeepTables, T, VEC>(cos + off_cos[k] + j);
        c2[k] = load_table<kKeepTables, T, VEC>(cos + off_cos[k] + half + j);
        s1[k] = load_table<kKeepTables, T, VEC>(sin + off_sin[k] + s_first + j);
        s2[k] = load_table<kKeepTables, T, VEC>(sin + off_sin[k] + s_second + j);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!valid[k]) continue;
        Chunk<T, VEC> y1, y2;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const A a1 = to_acc(x1[k].v[i]), a2 = to_acc(x2[k].v[i]);
          const A sn1 = sign * to_acc(s1[k].v[i]), sn2 = sign * to_acc(s2[k].v[i]);
          y1.v[i] = from_acc<T>(fma_acc(a1, to_acc(c1[k].v[i]), -(a2 * sn1)));
          y2.v[i] = from_acc<T>(fma_acc(a2, to_acc(c2[k].v[i]), a1 * sn2));
        }
        *reinterpret_cast<Chunk<T, VEC>*>(out + off_out[k] + j) = y1;
        *reinterpret_cast<Chunk<T, VEC>*>(out + off_out[k] + half + j) = y2;
      }
    }
  }
}

// Whether rows read the same row of a table (cos, sin) more than once: a broadcast dim.
bool reread(const RowIndexer& index, int64_t rows) {
  if (index.ndim == 0) return rows > 1;
  for (int i = 0; i < index.ndim; ++i)
    if (index.strides[i] == 0) return true;
  return false;
}

template <typename T, int VEC, bool kKeepTables>
cudaError_t launch(const T* in, T* out, const T* cos, const T* sin, const RopeLayout& layout,
                   bool backward, cudaStream_t stream) {
  constexpr auto kernel = rope_kernel<T, VEC, kKeepTables>;
  static std::atomic<int> resident_cache[kMaxDevices];
  int device = 0;
  DeviceInfo dev;
  const cudaError_t err = current_device(&device, &dev);
  if (err != cudaSuccess) return err;
  const int resident = once_per_device(resident_cache, device, [&](int) {
    return occupancy_units(kernel, kRopeThreads, 1, 0, dev.sm_count);
  });
  const int64_t chunks = layout.half / VEC;
  int tpr_log2 = 0;
  while ((int64_t{1} << tpr_log2) < chunks && (1 << tpr_log2) < kRopeMaxThreadsPerRow) ++tpr_log2;
  const int64_t rows_per_group = int64_t{kRopeThreads >> tpr_log2} * kRopeRowsPerThread;
  const int64_t groups = ceil_div(layout.rows, rows_per_group);
  const int64_t ctas = std::min<int64_t>(groups, resident > 0 ? resident : dev.sm_count);
  kernel<<<static_cast<unsigned>(ctas), kRopeThreads, 0, stream>>>(in, out, cos, sin, layout,
                                                                   tpr_log2, backward);
  return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_keeping(const T* in, T* out, const T* cos, const T* sin,
                           const RopeLayout& layout, bool backward, cudaStream_t stream) {
  if (reread(layout.cos, layout.rows) || reread(layout.sin, layout.rows))
    return launch<T, VEC, true>(in, out, cos, sin, layout, backward, stream);
  return launch<T, VEC, false>(in, out, cos, sin, layout, backward, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_rope(const T* in, T* out, const T* cos, const T* sin, const RopeLayout& layout,
                        bool backward, cudaStream_t stream) {
  if (layout.rows == 0 || layout.half == 0) return cudaSuccess;
  constexpr int kVec = 16 / sizeof(T);
  const int64_t elem = sizeof(T);
  const bool aligned = layout.half * elem % 16 == 0 && rows_aligned(in, layout.in, elem, 16) &&
                       rows_aligned(out, layout.out, elem, 16) &&
                       rows_aligned(cos, layout.cos, elem, 16) &&
                       rows_aligned(sin, layout.sin, elem, 16);
  if (aligned) return launch_keeping<T, kVec>(in, out, cos, sin, layout, backward, stream);
  return launch_keeping<T, 1>(in, out, cos, sin, layout, backward, stream);
}

#define MTI_INSTANTIATE(T)                                                                       \
  template cudaError_t launch_rope<T>(const T*, T*, const T*, const T*, const RopeLayout&, bool, \
                                      cudaStream_t);
MTI_FOR_EACH_DTYPE(MTI_INSTANTIATE)
#undef MTI_INSTANTIATE

}  // namespace mti
