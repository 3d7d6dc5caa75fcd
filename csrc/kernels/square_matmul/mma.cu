// The tensor-core staging kernel (fp16/bf16, sm_80+, fp16 also sm_75; staging.cuh): mma.sync
// m16n8k16 with fp32 accumulators, W tiles fed by a kStages-deep cp.async pipeline. The MMA
// computes the transposed product out^T = Wv^T x^T: W supplies the 16-row A operand and x the
// 8-wide B operand, so a block may own any multiple of 8 rows.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/mma_sync.cuh"
#include "kernels/square_matmul/staging.cuh"
#include "kernels/square_matmul/tuning.h"

namespace mti::square_matmul {

// BM rows per block and BN = 128 output columns per tile; warps in a WARPS_R x 4 grid, each
// computing 32 columns (two m16 tiles) for BM / WARPS_R rows (NT n8 tiles).
template <int BM_, int WARPS_R_>
struct MmaTile {
  static constexpr int BM = BM_;
  static constexpr int WARPS_R = WARPS_R_;
  static constexpr int WARPS_C = 4;
  static constexpr int THREADS = 32 * WARPS_R * WARPS_C;
  static constexpr int BN = 32 * WARPS_C;
  static constexpr int NT = BM / WARPS_R / 8;
  // Staged x rows: a pitch of kpad + 8 elements, an odd multiple of 16 bytes modulo 128, puts
  // the eight 16-byte rows that one ldmatrix reads in distinct banks.
  static constexpr int kXPad = kMmaXPad;
  static constexpr int kWBuffers = kStages;
  // W tile, unpadded and swizzled (see w_index): [BN][kBK] when transposed (a row of W^T is
  // a row of W), else [kBK][BN].
  __host__ __device__ static constexpr int w_tile_elems(bool) { return BN * kBK; }
  static_assert(NT >= 1 && BM % (8 * WARPS_R) == 0, "whole n8 tiles per warp");
};

namespace {

namespace cg = cooperative_groups;

template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void mma_body(const Args<T>& a) {
  constexpr int BM = Tile::BM, BN = Tile::BN, NT = Tile::NT;
  constexpr int W_TILE = Tile::w_tile_elems(TRANS);
  constexpr int WROWS = BM / Tile::WARPS_R;

  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* row_off = reinterpret_cast<int64_t*>(smem);
  T* xs = reinterpret_cast<T*>(smem + BM * sizeof(int64_t));
  T* ws = xs + BM * a.ldx;

  const BlockWork b = block_work<T, BM, BN>(a);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_r = warp / Tile::WARPS_C, warp_c = warp % Tile::WARPS_C;

  auto load_w = [&](int t) {
    const int ct = b.ct_begin + t / b.k_tiles, kt = t % b.k_tiles;
    load_w_tile<T, TRANS, Tile>(a, ws + (t % kStages) * W_TILE, ct * BN, kt * kBK);
  };

  stage_rows<T, BM, Tile::THREADS>(a, b.row0, b.nrows, row_off, xs);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < b.tiles) load_w(s);
    cp_async_commit();
  }
  __syncthreads();
  if (a.grid_sync) cg::this_grid().sync();

  // ldmatrix roles: lane supplies the address of row (lane & 7) of 8x8 matrix (lane >> 3).
  const int mi = lane >> 3, mr = lane & 7;
  const T* xw = xs + (warp_r * WROWS + mr) * a.ldx + (mi & 1) * 8;  // this lane's B rows
  float acc[2][NT][4] = {};
  for (int t = 0; t < b.tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile t landed for every thread; buffer (t - 1) % kStages is free
    if (t + kStages - 1 < b.tiles) load_w(t + kStages - 1);
    cp_async_commit();

    const T* wt = ws + (t % kStages) * W_TILE;
    const int kt = t % b.k_tiles;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      // A = Wv^T: rows j (output columns), 16 x 16 per m16 tile. Matrices in fragment order:
      // (j 0-7, k 0-7), (j 8-15, k 0-7), (j 0-7, k 8-15), (j 8-15, k 8-15).
      uint32_t af[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int j = warp_c * 32 + mt * 16 + (mi & 1) * 8;
        const int k = kk + (mi >> 1) * 8;
        if constexpr (TRANS)
          ldsm_x4<false>(af[mt], smem_u32(wt + w_index<kBK>(j + mr, k)));  // stored [j][k]
        else
          ldsm_x4<true>(af[mt], smem_u32(wt + w_index<BN>(k + mr, j)));  // [k][j]: transpose
      }
      // B = x^T: columns are x rows, stored [n][k]; per n8 tile (k 0-7), (k 8-15). Matrices
      // of an x4: (tile nt, k lo), (nt, k hi), (nt + 1, k lo), (nt + 1, k hi).
      uint32_t bf[NT][2];
      const T* xk = xw + kt * kBK + kk;
#pragma unroll
      for (int nt = 0; nt + 1 < NT; nt += 2) {
        uint32_t r[4];
        ldsm_x4<false>(r, smem_u32(xk + (nt + (mi >> 1)) * 8 * a.ldx));
        bf[nt][0] = r[0];
        bf[nt][1] = r[1];
        bf[nt + 1][0] = r[2];
        bf[nt + 1][1] = r[3];
      }
      if constexpr (NT % 2 == 1) {
        uint32_t r[2];
        ldsm_x2(r, smem_u32(xk + (NT - 1) * 8 * a.ldx));
        bf[NT - 1][0] = r[0];
        bf[NT - 1][1] = r[1];
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816<T>(acc[mt][nt], af[mt], bf[nt]);
    }

    if (kt == b.k_tiles - 1) {
      // Accumulator (mt, nt): c[0..1] at (j = g, n = 2q, 2q + 1), c[2..3] at j = g + 8.
      const int ct = b.ct_begin + t / b.k_tiles;
      const int g = lane >> 2, q = lane & 3;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int j = ct * BN + warp_c * 32 + mt * 16 + g;
          const int n = warp_r * WROWS + nt * 8 + 2 * q;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            store_out(a, row_off, b.nrows, n, j + 8 * h, acc[mt][nt][2 * h]);
            store_out(a, row_off, b.nrows, n + 1, j + 8 * h, acc[mt][nt][2 * h + 1]);
            acc[mt][nt][2 * h] = acc[mt][nt][2 * h + 1] = 0.f;
          }
        }
    }
  }
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS) mma_kernel(const __grid_constant__ Args<T> a) {
  if constexpr (has_mma<T>())
    mma_body<T, TRANS, Tile>(a);
  else
    __trap();
}

}  // namespace

struct MmaStaging {
  using Tiles = MmaTiles;
  static constexpr const Tunable& kWCost = kMmaWCost;
  template <typename T, bool TRANS, class Tile>
  static auto kernel() {
    return &mma_kernel<T, TRANS, Tile>;
  }
};

template int64_t staging_max_k<MmaStaging>(size_t, int);

MTI_INSTANTIATE_STAGING(MmaStaging, __half)
MTI_INSTANTIATE_STAGING(MmaStaging, __nv_bfloat16)

}  // namespace mti::square_matmul
