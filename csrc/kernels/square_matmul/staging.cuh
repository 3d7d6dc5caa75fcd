// The staging kernels (mma.cu on tensor cores, fma.cu on FFMA): x <- x @ W (or x @ W^T) + bias
// with no memory beyond x, W and bias.
//
// A thread block owns BM whole rows of x. It copies them (all K columns) into shared memory,
// and only then starts writing: every output element of its rows is computed from the staged
// copy, so the results can go straight over x in global memory. Blocks own disjoint rows, so
// no block reads what another writes. When there are too few row blocks to fill the GPU,
// several blocks share a row block, each computing a slice of the output columns; they are
// launched cooperatively and wait for each other (grid sync) between staging and writing.
// The rows' output is produced column tile by column tile: a BN-column tile accumulates over
// K in kBK steps, each step a (kBK x BN) tile of W staged in shared memory. Every block streams
// all of W from L2, so the rows per block (as many as shared memory holds) set the arithmetic
// per byte of W, which bounds the speed at large K.
//
// Here: the device code both kernels share, and their host side (tile choice, split, launch).
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"

namespace mti::square_matmul {

// Row offsets go to row_off[0, BM); rows [0, BM) x columns [0, kpad) to xs (pitch ldx),
// zero past the last row and past K. Plain loads: it runs once per block, and the loads
// have all returned (into shared memory) when this returns, which the grid sync relies on.
template <typename T, int BM, int THREADS>
__device__ __forceinline__ void stage_rows(const Args<T>& a, int64_t row0, int nrows,
                                           int64_t* row_off, T* xs) {
  for (int i = threadIdx.x; i < BM; i += THREADS)
    row_off[i] = i < nrows ? a.row.offset(row0 + i) : 0;
  __syncthreads();
  if (a.x_vec) {
    constexpr int V = 16 / sizeof(T);
    const int chunks = a.kpad / V;  // per row
    for (int c = threadIdx.x; c < BM * chunks; c += THREADS) {
      const int r = c / chunks, col = (c - r * chunks) * V;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < nrows && col < a.k) v = *reinterpret_cast<const uint4*>(a.x + row_off[r] + col);
      *reinterpret_cast<uint4*>(xs + r * a.ldx + col) = v;
    }
  } else {
    for (int e = threadIdx.x; e < BM * a.kpad; e += THREADS) {
      const int r = e / a.kpad, col = e - r * a.kpad;
      xs[r * a.ldx + col] = r < nrows && col < a.k ? a.x[row_off[r] + col] : zero<T>();
    }
  }
}

// The block's rows and column tiles: rows [row0, row0 + nrows), column tiles
// [ct_begin, ct_end) of BN columns each, walked as (ct_end - ct_begin) * k_tiles W tiles.
struct BlockWork {
  int64_t row0;
  int nrows;
  int ct_begin, ct_end;
  int k_tiles;
  int tiles;
};

template <typename T, int BM, int BN>
__device__ __forceinline__ BlockWork block_work(const Args<T>& a) {
  BlockWork b;
  b.row0 = (a.first_block + blockIdx.x) * BM;
  b.nrows = static_cast<int>(min(static_cast<int64_t>(BM), a.rows - b.row0));
  const int col_tiles = (a.k + BN - 1) / BN;
  b.ct_begin = blockIdx.y * a.col_tiles_per_block;
  b.ct_end = min(col_tiles, b.ct_begin + a.col_tiles_per_block);
  b.k_tiles = a.kpad / kBK;
  b.tiles = (b.ct_end - b.ct_begin) * b.k_tiles;
  return b;
}

// Writes out[n][j] = v + bias[j] over x when the element exists.
template <typename T>
__device__ __forceinline__ void store_out(const Args<T>& a, const int64_t* row_off, int nrows,
                                          int n, int j, float v) {
  if (n < nrows && j < a.k)
    a.x[row_off[n] + j] = from_float<T>(a.bias ? v + to_float(a.bias[j]) : v);
}

// ---------------------------------------------------------------------------------------
// Host side.

template <class Tile>
size_t smem_bytes(int kpad, bool trans, size_t elem) {
  return Tile::BM * sizeof(int64_t) + static_cast<size_t>(Tile::BM) * (kpad + Tile::kXPad) * elem +
         static_cast<size_t>(Tile::kWBuffers) * Tile::w_tile_elems(trans) * elem;
}

// Largest K (a multiple of kBK) whose tile of Tile fits, for either transpose.
template <class Tile>
int64_t tile_max_k(size_t elem, int smem_optin) {
  const size_t w = static_cast<size_t>(Tile::kWBuffers) *
                   std::max(Tile::w_tile_elems(true), Tile::w_tile_elems(false)) * elem;
  const size_t fixed = Tile::BM * sizeof(int64_t) + w;
  if (static_cast<size_t>(smem_optin) <= fixed) return 0;
  const int64_t pitch = static_cast<int64_t>((smem_optin - fixed) / (Tile::BM * elem));
  return std::max<int64_t>(0, (pitch - Tile::kXPad) / kBK * kBK);
}

template <class... Tiles>
int64_t family_max_k(TileList<Tiles...>, size_t elem, int smem_optin) {
  return std::max({tile_max_k<Tiles>(elem, smem_optin)...});
}

// How the work is divided: row_blocks blocks of BM rows along gridDim.x, and the column tiles
// in slices of per_block along gridDim.y (slices > 1 needs the cooperative launch).
struct Split {
  int64_t row_blocks;
  int per_block;
  int slices;
};

// Too few row blocks to occupy the GPU: slice the columns among blocks that share rows.
inline bool may_slice(int64_t row_blocks, int col_tiles, const DeviceInfo& d) {
  return row_blocks < d.sm_count && col_tiles > 1 && d.coop;
}

// As many slices as `resident` blocks allow (the grid sync needs every block resident).
inline Split split_work(int64_t rows, int bm, int col_tiles, int64_t resident,
                        const DeviceInfo& d) {
  Split s{(rows + bm - 1) / bm, col_tiles, 1};
  if (may_slice(s.row_blocks, col_tiles, d)) {
    const int64_t want =
        std::min<int64_t>(col_tiles, std::max<int64_t>(1, resident / s.row_blocks));
    s.per_block = static_cast<int>((col_tiles + want - 1) / want);
    s.slices = (col_tiles + s.per_block - 1) / s.per_block;  // none left empty
  }
  return s;
}

// Estimated time of a launch with Tile, in arbitrary units (INT64_MAX: it does not fit): the
// blocks run in waves of one per multiprocessor, each block doing per_block column tiles, and
// a column tile costs streaming its W tiles (w_cost, in rows' worth of arithmetic: tuning.h)
// plus BM rows of arithmetic.
template <class Tile>
int64_t launch_cost(int64_t rows, int k, int kpad, bool trans, size_t elem, int64_t w_cost,
                    const DeviceInfo& d) {
  const size_t smem = smem_bytes<Tile>(kpad, trans, elem);
  if (smem > static_cast<size_t>(d.smem_optin)) return INT64_MAX;
  const int col_tiles = (k + Tile::BN - 1) / Tile::BN;
  const int64_t per_sm =
      std::max<int64_t>(1, std::min<int64_t>(d.smem_per_sm / (smem + d.smem_reserved),
                                             d.threads_per_sm / Tile::THREADS));
  const Split s = split_work(rows, Tile::BM, col_tiles, per_sm * d.sm_count, d);
  const int64_t waves = (s.row_blocks * s.slices + d.sm_count - 1) / d.sm_count;
  return waves * s.per_block * (w_cost + Tile::BM);
}

// Index of the tile to use: the cheapest by launch_cost, the one with more rows on a tie
// (less W traffic in total); -1 when none fits.
template <class... Tiles>
int pick_tile(TileList<Tiles...>, int64_t rows, int k, int kpad, bool trans, size_t elem,
              int64_t w_cost, const DeviceInfo& d) {
  const int64_t cost[] = {launch_cost<Tiles>(rows, k, kpad, trans, elem, w_cost, d)...};
  int best = -1;
  for (int i = 0; i < static_cast<int>(sizeof...(Tiles)); ++i)
    if (cost[i] < INT64_MAX && (best < 0 || cost[i] < cost[best])) best = i;
  return best;
}

// Launches `kernel`, of Tile, on the rows of a: blocks of Tile::BM rows, the column tiles
// sliced among blocks that share rows where too few row blocks fill the GPU.
template <typename T, bool TRANS, class Tile, class Kernel>
cudaError_t launch_tile(Kernel kernel, Args<T> a, const DeviceInfo& d, cudaStream_t stream) {
  const size_t smem = smem_bytes<Tile>(a.kpad, TRANS, sizeof(T));
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;

  const int col_tiles = (a.k + Tile::BN - 1) / Tile::BN;
  Split s{(a.rows + Tile::BM - 1) / Tile::BM, col_tiles, 1};
  if (may_slice(s.row_blocks, col_tiles, d)) {
    // The exact number of blocks that fit at once, for the cooperative launch.
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Tile::THREADS, smem);
    if (err != cudaSuccess) return err;
    s = split_work(a.rows, Tile::BM, col_tiles, static_cast<int64_t>(per_sm) * d.sm_count, d);
  }
  a.col_tiles_per_block = s.per_block;
  a.grid_sync = s.slices > 1;

  if (a.grid_sync) {
    void* params[] = {&a};
    err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
                                      dim3(static_cast<unsigned>(s.row_blocks), s.slices),
                                      dim3(Tile::THREADS), params, smem, stream);
    if (err != cudaSuccess) return err;
    return cudaGetLastError();
  }
  for (int64_t first = 0; first < s.row_blocks; first += INT_MAX) {
    a.first_block = first;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(s.row_blocks - first, INT_MAX));
    kernel<<<dim3(blocks, 1), Tile::THREADS, smem, stream>>>(a);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// launch.h's staging functions, for a Staging of the kernel's file: its Tiles (a TileList),
// kWCost (its table of what a W tile costs) and kernel<T, TRANS, Tile>().
template <class Staging>
int64_t staging_max_k(size_t elem, int smem_optin) {
  return family_max_k(typename Staging::Tiles{}, elem, smem_optin);
}

template <class Staging, typename T>
int staging_tile(const Args<T>& a, bool trans, const DeviceInfo& d) {
  const int64_t w_cost = tuned(Staging::kWCost, tuning_key(d, sizeof(T), a.k));
  return pick_tile(typename Staging::Tiles{}, a.rows, a.k, a.kpad, trans, sizeof(T), w_cost, d);
}

template <class Staging, typename T>
cudaError_t launch_staging(const Args<T>& a, bool trans, int tile, const DeviceInfo& d,
                           cudaStream_t stream) {
  return with_tile(typename Staging::Tiles{}, tile, cudaErrorInvalidValue, [&](auto t) {
    using Tile = decltype(t);
    return trans
               ? launch_tile<T, true, Tile>(Staging::template kernel<T, true, Tile>(), a, d, stream)
               : launch_tile<T, false, Tile>(Staging::template kernel<T, false, Tile>(), a, d,
                                             stream);
  });
}

// The instantiations of the functions above for a kernel's file.
#define MTI_INSTANTIATE_STAGING(STAGING, T)                                                     \
  template int staging_tile<STAGING, T>(const Args<T>&, bool, const DeviceInfo&);               \
  template cudaError_t launch_staging<STAGING, T>(const Args<T>&, bool, int, const DeviceInfo&, \
                                                  cudaStream_t);

}  // namespace mti::square_matmul
