// The FMA staging kernel (float; fp16/bf16 without tensor cores; staging.cuh). 8 warps; warp
// w owns rows w + 8 i (i < RM) and lane l the columns l + 32 q (q < 4) of a BN = 128 column
// tile. W tiles are double-buffered in shared memory, the next one prefetched into registers
// meanwhile.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/staging.cuh"
#include "kernels/square_matmul/tuning.h"

namespace mti::square_matmul {

template <int BM_>
struct FmaTile {
  static constexpr int BM = BM_;
  static constexpr int THREADS = 256;
  static constexpr int BN = 128;
  static constexpr int RM = BM / 8;
  // Staged rows are read by broadcast (a warp reads one row), so need no pad.
  static constexpr int kXPad = kFmaXPad;
  static constexpr int kWBuffers = 2;
  // W tile: [BN][kBK + 1] when transposed (lanes read 32 rows j at one k: the odd pitch
  // spreads them over all banks), else [kBK][BN] (lanes read consecutive j).
  __host__ __device__ static constexpr int w_ld(bool trans) { return trans ? kBK + 1 : BN; }
  __host__ __device__ static constexpr int w_tile_elems(bool trans) {
    return (trans ? BN : kBK) * w_ld(trans);
  }
  static_assert(RM >= 1 && BM % 8 == 0, "8 warps own the rows");
};

namespace {

namespace cg = cooperative_groups;

template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void fma_body(const Args<T>& a) {
  constexpr int BM = Tile::BM, BN = Tile::BN, RM = Tile::RM, THREADS = Tile::THREADS;
  constexpr int W_LD = Tile::w_ld(TRANS);
  constexpr int W_TILE = Tile::w_tile_elems(TRANS);
  constexpr int COLS = TRANS ? kBK : BN;  // tile columns contiguous in W
  constexpr int PER_THREAD = kBK * BN / THREADS;

  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* row_off = reinterpret_cast<int64_t*>(smem);
  T* xs = reinterpret_cast<T*>(smem + BM * sizeof(int64_t));
  T* ws = xs + BM * a.ldx;

  const BlockWork b = block_work<T, BM, BN>(a);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Element e of a tile is tile row e / COLS, column e % COLS: W row g0 + row from column
  // c0 + column, (g0, c0) as in load_w_tile. Consecutive threads read consecutive columns.
  T pre[PER_THREAD];
  auto fetch = [&](int t) {
    const int j0 = (b.ct_begin + t / b.k_tiles) * BN, k0 = t % b.k_tiles * kBK;
    const int g0 = TRANS ? j0 : k0, c0 = TRANS ? k0 : j0;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int e = threadIdx.x + i * THREADS, r = e / COLS, col = e % COLS;
      pre[i] = w_or_zero(a, g0 + r, c0 + col);
    }
  };
  auto store = [&](int t) {
    T* dst = ws + (t & 1) * W_TILE;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int e = threadIdx.x + i * THREADS;
      dst[e / COLS * W_LD + e % COLS] = pre[i];
    }
  };

  stage_rows<T, BM, THREADS>(a, b.row0, b.nrows, row_off, xs);
  if (b.tiles > 0) {
    fetch(0);
    store(0);
  }
  __syncthreads();
  if (a.grid_sync) cg::this_grid().sync();

  // Blocked summation: each k-tile is summed on its own (part) before it joins the total
  // (acc), so rounding error grows with kBK + K / kBK rather than with K, as in a tiled GEMM.
  float acc[RM][4] = {};
  for (int t = 0; t < b.tiles; ++t) {
    if (t + 1 < b.tiles) fetch(t + 1);
    const T* wt = ws + (t & 1) * W_TILE;
    const T* xt = xs + warp * a.ldx + t % b.k_tiles * kBK;
    float part[RM][4] = {};
#pragma unroll 4
    for (int kk = 0; kk < kBK; ++kk) {
      float xv[RM], wv[4];
#pragma unroll
      for (int i = 0; i < RM; ++i) xv[i] = to_float(xt[i * 8 * a.ldx + kk]);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wv[c] = to_float(TRANS ? wt[(lane + 32 * c) * W_LD + kk] : wt[kk * W_LD + lane + 32 * c]);
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[i][c] = fmaf(xv[i], wv[c], part[i][c]);
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][c] += part[i][c];
    if (t + 1 < b.tiles) store(t + 1);  // the other buffer: its readers passed the last barrier
    __syncthreads();

    if (t % b.k_tiles == b.k_tiles - 1) {
      const int j = (b.ct_begin + t / b.k_tiles) * BN + lane;
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          store_out(a, row_off, b.nrows, warp + 8 * i, j + 32 * c, acc[i][c]);
          acc[i][c] = 0.f;
        }
    }
  }
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS) fma_kernel(const __grid_constant__ Args<T> a) {
  fma_body<T, TRANS, Tile>(a);
}

}  // namespace

struct FmaStaging {
  using Tiles = FmaTiles;
  static constexpr const Tunable& kWCost = kFmaWCost;
  template <typename T, bool TRANS, class Tile>
  static auto kernel() {
    return &fma_kernel<T, TRANS, Tile>;
  }
};

template int64_t staging_max_k<FmaStaging>(size_t, int);

MTI_INSTANTIATE_STAGING(FmaStaging, float)
MTI_INSTANTIATE_STAGING(FmaStaging, __half)
MTI_INSTANTIATE_STAGING(FmaStaging, __nv_bfloat16)

}  // namespace mti::square_matmul
