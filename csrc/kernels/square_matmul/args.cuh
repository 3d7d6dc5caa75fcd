// What every square_matmul_ kernel is given (Args, built on the host by make_args), and the
// small device helpers that several of them share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "kernels/common.cuh"
#include "kernels/row_layout.h"
#include "kernels/square_matmul/tuning.h"

namespace mti::square_matmul {

// Staged x row pitch = kpad + pad (see MmaTile, FmaTile).
constexpr int kMmaXPad = 8;
constexpr int kFmaXPad = 0;

__host__ __device__ constexpr int round_up(int a, int b) { return (a + b - 1) / b * b; }

template <typename T>
struct Args {
  T* x;
  RowIndexer row;
  int64_t rows;
  int64_t first_block;  // row block of blockIdx.x == 0 (grids are split at 2^31 - 1 blocks)
  int k;
  int kpad;  // K rounded up to kBK: the staged rows are zero beyond K
  int ldx;   // pitch of the staged rows in shared memory, in elements
  const T* w;
  const T* bias;            // nullptr: no bias
  int col_tiles_per_block;  // column tiles per block: gridDim.y slices them (staging kernels)
                            // or the blocks of a cluster do (streaming kernel)
  int cluster;              // blocks per cluster, which share a row block (streaming kernel)
  bool x_vec;               // x rows start 16-byte aligned and K fills whole 16-byte chunks
  bool w_vec;               // W likewise
  bool grid_sync;           // blocks share row blocks: all stage before any writes
};

// The arguments every kernel shares; mma: the tensor-core staging kernel's row pitch.
template <typename T>
Args<T> make_args(T* x, const RowLayout& layout, const T* w, const T* bias, bool mma) {
  Args<T> a{};
  a.x = x;
  a.row = layout.row;
  a.rows = layout.rows;
  a.k = static_cast<int>(layout.n);
  a.kpad = round_up(a.k, kBK);
  a.ldx = a.kpad + (mma ? kMmaXPad : kFmaXPad);
  a.w = w;
  a.bias = bias;
  constexpr int V = 16 / sizeof(T);
  bool rows_aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && a.k % V == 0;
  for (int i = 0; i < layout.row.ndim; ++i) rows_aligned &= layout.row.strides[i] % V == 0;
  a.x_vec = rows_aligned;
  a.w_vec = reinterpret_cast<uintptr_t>(w) % 16 == 0 && a.k % V == 0;
  return a;
}

template <typename T>
__device__ __forceinline__ T zero() {
  return from_float<T>(0.f);
}

// W[g][c], or zero outside W. The load always reads inside W (its first element when
// outside): __ldg of a 16-bit type is inline assembly, which the compiler may take for pure
// and hoist above the bounds test.
template <typename T>
__device__ __forceinline__ T w_or_zero(const Args<T>& a, int g, int c) {
  const bool in = g < a.k && c < a.k;
  return in ? __ldg(a.w + (in ? static_cast<int64_t>(g) * a.k + c : 0)) : zero<T>();
}

// bias[j] and bias[j + 1], zeros without a bias or past K (which is even). Plain loads: __ldg
// of a 16-bit type is inline assembly, which the compiler may take for pure and hoist above
// the null test (an __ldg here read address 0x12 on an H100).
template <typename T>
__device__ __forceinline__ float2 bias_pair(const Args<T>& a, int j) {
  if (a.bias == nullptr || j >= a.k) return make_float2(0.f, 0.f);
  return make_float2(to_float(a.bias[j]), to_float(a.bias[j + 1]));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T v[2] = {from_float<T>(lo), from_float<T>(hi)};
  uint32_t r;
  memcpy(&r, v, sizeof(r));
  return r;
}

// Every thread of every block of the cluster arrives; the release/acquire pair orders each
// block's reads of x before any block's writes after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// Calls f(Tile{}) for the index-th tile of a TileList and returns its result (`none` for an
// index past the list).
template <class R, class F, class... Tiles>
R with_tile(TileList<Tiles...>, int index, R none, F&& f) {
  R result = none;
  int i = 0;
  ((i++ == index ? (result = f(Tiles{}), 0) : 0), ...);
  return result;
}

}  // namespace mti::square_matmul
