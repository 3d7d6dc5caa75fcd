// The streaming kernels (stream.cu on mma.sync, wgmma_stream.cu on the warpgroup MMA;
// fp16/bf16 on sm_90, 16-byte chunks of x and W) stage the block's outputs instead of its
// inputs: a thread-block cluster shares a row block, each block computing a slice of its
// output column tiles and parking them in shared memory until a cluster barrier says all of
// the rows' inputs have been read. So a block need not hold whole input rows and does many
// more rows per W tile than a staging kernel (staging.cuh).
//
// Here: the writing of the parked tiles over x, and the host side (plan and launch) that the
// two kernels share.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/select.h"
#include "kernels/square_matmul/tuning.h"
#include "kernels/square_matmul/wgmma_tile.cuh"

namespace mti::square_matmul {

// The streaming kernels' last step: the block's column tiles [ct_begin, ct_end) of its nrows
// rows, parked at outs (pitch out_ld; all but the last) and in the stages (the last, pitch
// Tile::LAST_LD), go over x, 16 bytes at a time, after a barrier that orders the reads of x
// (the whole cluster's) before the writes and makes the parked tiles visible block-wide.
template <typename T, class Tile>
__device__ __forceinline__ void write_parked(const Args<T>& a, const int64_t* row_off, int nrows,
                                             const T* outs, int out_ld, const T* stages,
                                             int ct_begin, int ct_end, int parked) {
  constexpr int BN = Tile::BN;
  if (a.cluster > 1)
    cluster_sync();
  else
    __syncthreads();
  const int col0 = ct_begin * BN;
  const int last0 = parked * BN;                          // the last tile's first column, from col0
  const int chunks = (min(ct_end * BN, a.k) - col0) / 8;  // per row; K is a multiple of 8
  for (int c = threadIdx.x; c < nrows * chunks; c += Tile::THREADS) {
    const int r = c / chunks, col = (c - r * chunks) * 8;
    const T* src =
        col < last0 ? outs + r * out_ld + col : stages + r * Tile::LAST_LD + (col - last0);
    *reinterpret_cast<uint4*>(a.x + row_off[r] + col0 + col) = *reinterpret_cast<const uint4*>(src);
  }
}

// ---------------------------------------------------------------------------------------
// Host side.

template <class Tile>
size_t stream_smem_bytes(int tpc, size_t elem) {
  return Tile::kSmemSlack + Tile::BM * sizeof(int64_t) +
         (static_cast<size_t>(Tile::kStages) * Tile::STAGE +
          static_cast<size_t>(Tile::BM) * ((tpc - 1) * Tile::BN + Tile::kOutPad)) *
             elem;
}

// `kernel`, of Tile, with its shared memory limit raised to smem and, for clusters past the
// portable 8, non-portable sizes allowed; and its launch configuration for row_blocks row
// blocks in clusters of `cluster` (the grid at most INT_MAX blocks; see launch_stream_tile).
template <class Tile, class Kernel>
cudaError_t cluster_launch_config(Kernel kernel, size_t smem, int cluster, int64_t row_blocks,
                                  cudaStream_t stream, cudaLaunchAttribute* attr,
                                  cudaLaunchConfig_t* cfg) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err == cudaSuccess && cluster > 8)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  *attr = cluster_dims(cluster);
  *cfg = {};
  cfg->blockDim = dim3(Tile::THREADS);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = stream;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  cfg->gridDim =
      dim3(static_cast<unsigned>(std::min<int64_t>(row_blocks, INT_MAX / cluster) * cluster));
  return err;
}

// Clusters of `cluster` blocks of `kernel` (of T, TRANS and Tile) that the current device
// runs at once (0: none fits). Not simply the multiprocessors divided by the cluster size: a
// cluster's blocks share a GPC, so on an H100 (132 SMs, one block per SM) 30 clusters of 4
// fit, 15 of 8 and 7 of 16. Asked once per device and cluster size; blocks per SM are bound
// by registers, not by the shared memory of the plan at hand (Tile::kBlocksPerSm = 1).
template <typename T, bool TRANS, class Tile, class Kernel>
int64_t resident_clusters(Kernel kernel, int cluster, size_t smem) {
  static_assert(Tile::kBlocksPerSm == 1, "occupancy cached per cluster size only");
  static std::atomic<int> cache[Tile::kMaxCluster + 1][kMaxDevices];
  return once_per_device(cache[cluster], [&](int) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg;
    int clusters = 0;
    // A cluster size the device refuses: none resident, not an error of the op.
    return cluster_launch_config<Tile>(kernel, smem, cluster, 1, nullptr, &attr, &cfg) ==
                       cudaSuccess &&
                   cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess
               ? clusters
               : 0;
  });
}

// The cheapest split of the column tiles among the blocks of a cluster: waves of the clusters
// that are resident at once (resident_clusters), the blocks that share a multiprocessor in a
// wave sharing its throughput, each block doing tpc column tiles, and a column tile costing
// its BM rows of MMAs plus streaming its BM + BN rows of x and W from L2, load_rows of them
// (tuning.h) costing a row of MMAs. Smaller clusters win ties: a cluster of 2 blocks of 2
// tiles beats one of 4 blocks of 1 tile, which takes more waves of fewer resident clusters.
// Where the blocks multicast x (Tile::kTma), each loads BM / cluster rows of it. Launches
// whose blocks would not fill half of the multiprocessors are left to the staging kernels,
// which slice the columns finer.
template <typename T, bool TRANS, class Tile, class Kernel>
StreamConfig plan_stream(Kernel kernel, int64_t rows, int k, int64_t load_rows,
                         const DeviceInfo& d) {
  StreamConfig best;
  const int col_tiles = (k + Tile::BN - 1) / Tile::BN;
  const int64_t row_blocks = (rows + Tile::BM - 1) / Tile::BM;
  for (int cluster = 1; cluster <= std::min(Tile::kMaxCluster, col_tiles); ++cluster) {
    const int tpc = (col_tiles + cluster - 1) / cluster;
    if ((col_tiles + tpc - 1) / tpc != cluster) continue;     // a block would be left empty
    if (Tile::kTma && Tile::BM / 8 % cluster != 0) continue;  // whole 8-row pieces
    if (2 * row_blocks * cluster < d.sm_count) continue;
    const size_t smem = stream_smem_bytes<Tile>(tpc, sizeof(T));
    if (smem > static_cast<size_t>(d.smem_optin)) continue;
    const int64_t resident = resident_clusters<T, TRANS, Tile>(kernel, cluster, smem);
    if (resident == 0) continue;
    const int64_t per_sm = std::max<int64_t>(1, ceil_div(resident * cluster, d.sm_count));
    const int64_t waves = ceil_div(row_blocks, resident);
    const int x_rows = Tile::kTma ? Tile::BM / cluster : Tile::BM;  // loaded per block
    const int64_t cost = waves * per_sm * tpc * (Tile::BM + (x_rows + Tile::BN) / load_rows);
    if (cost < best.cost) {
      best.tpc = tpc;
      best.cluster = cluster;
      best.cost = cost;
    }
  }
  return best;
}

// The cheapest of plan(Tile{}) over the tiles of a TileList, with its index in the list (cost
// INT64_MAX: none fits). The first (more rows per block) wins a tie.
template <class F, class... Tiles>
StreamConfig cheapest(TileList<Tiles...>, F&& plan) {
  StreamConfig plans[] = {plan(Tiles{})...};
  int best = 0;
  for (int i = 1; i < static_cast<int>(sizeof...(Tiles)); ++i)
    if (plans[i].cost < plans[best].cost) best = i;
  plans[best].tile = best;
  return plans[best];
}

// Launches `kernel`, of Tile, with plan p (which fits: plan_stream checked).
template <typename T, bool TRANS, class Tile, class Kernel>
cudaError_t launch_stream_tile(Kernel kernel, Args<T> a, const StreamConfig& p,
                               cudaStream_t stream) {
  a.col_tiles_per_block = p.tpc;
  a.cluster = p.cluster;
  // Blocks blockIdx.x = cluster * b + rank: row block first_block + b, column slice rank.
  // The warpgroup kernel's tensor-map coordinates (row b * BM + ...) are 32-bit.
  const int64_t row_blocks = (a.rows + Tile::BM - 1) / Tile::BM;
  const int64_t per_launch =  // row blocks
      Tile::kTma ? std::min(INT_MAX / p.cluster, INT_MAX / Tile::BM - 1) : INT_MAX / p.cluster;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg;
  cudaError_t err = cluster_launch_config<Tile>(kernel, stream_smem_bytes<Tile>(p.tpc, sizeof(T)),
                                                p.cluster, row_blocks, stream, &attr, &cfg);
  if (err != cudaSuccess) return err;
  for (int64_t first = 0; first < row_blocks; first += per_launch) {
    a.first_block = first;
    const int64_t blocks = std::min(row_blocks - first, per_launch);
    cfg.gridDim = dim3(static_cast<unsigned>(blocks * p.cluster));
    if constexpr (Tile::kTma) {
      TmaMaps maps;
      const int64_t row0 = first * Tile::BM;
      err = make_maps<T, TRANS, Tile>(a, row0, std::min(a.rows - row0, blocks * Tile::BM),
                                      p.cluster, &maps);
      if (err == cudaSuccess) err = cudaLaunchKernelEx(&cfg, kernel, a, maps);
    } else {
      err = cudaLaunchKernelEx(&cfg, kernel, a);
    }
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

// launch.h's streaming functions, for a Streaming of the kernel's file: its Tiles (a
// TileList) and kernel<T, TRANS, Tile>().
template <class Streaming, typename T>
StreamConfig stream_config(const Args<T>& a, bool trans, const DeviceInfo& d) {
  const int64_t load_rows = tuned(kStreamLoadRows, tuning_key(d, sizeof(T), a.k));
  const auto cheapest_for = [&](auto trans_c) {
    constexpr bool TRANS = decltype(trans_c)::value;
    return cheapest(typename Streaming::Tiles{}, [&](auto tile) {
      using Tile = decltype(tile);
      return plan_stream<T, TRANS, Tile>(Streaming::template kernel<T, TRANS, Tile>(), a.rows, a.k,
                                         load_rows, d);
    });
  };
  return trans ? cheapest_for(std::true_type{}) : cheapest_for(std::false_type{});
}

template <class Streaming, typename T>
cudaError_t launch_stream(const Args<T>& a, bool trans, const StreamConfig& c,
                          cudaStream_t stream) {
  return with_tile(typename Streaming::Tiles{}, c.tile, cudaErrorInvalidValue, [&](auto tile) {
    using Tile = decltype(tile);
    return trans ? launch_stream_tile<T, true, Tile>(Streaming::template kernel<T, true, Tile>(), a,
                                                     c, stream)
                 : launch_stream_tile<T, false, Tile>(Streaming::template kernel<T, false, Tile>(),
                                                      a, c, stream);
  });
}

// The instantiations of the functions above for a kernel's file.
#define MTI_INSTANTIATE_STREAM(STREAMING, T)                                                  \
  template StreamConfig stream_config<STREAMING, T>(const Args<T>&, bool, const DeviceInfo&); \
  template cudaError_t launch_stream<STREAMING, T>(const Args<T>&, bool, const StreamConfig&, \
                                                   cudaStream_t);

}  // namespace mti::square_matmul
