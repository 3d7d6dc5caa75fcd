// The warpgroup streaming kernel (fp16/bf16, sm_90a builds on sm_90): the streaming scheme
// (stream.cuh: a cluster shares a row block of BM rows; each block computes its column tiles,
// parks them on chip and writes them over x after a cluster barrier) on Hopper's warpgroup
// MMA (wgmma_tile.cuh), fed by the TMA. A producer warp issues the loads kStages steps ahead,
// and mbarriers say when a stage is full (its bytes landed) and when it is empty (every block
// that wrote into it has had its MMAs finish reading it). Every block of a cluster needs the
// same x tiles, so each loads BM / cluster rows of a tile and multicasts them to all: L2
// serves x once per cluster, not once per block. Each step has a fixed cost (barrier waits
// and arrivals across the cluster), so steps are as long as the 128-byte swizzle allows. So
// that every block waits for the same x tiles, all blocks of a cluster walk tpc column tiles;
// a block with fewer (the last, when the tiles do not split evenly) consumes the x tiles of
// the missing ones without MMAs.
// Column tiles of BN = 256, so K = 4096 takes a cluster of 8 blocks of two tiles (or 16 of
// one); K = 8192 one of 16 blocks of two (the H100 schedules 16, not every sm_90 part: there
// no plan fits and the mma.sync kernels run). x's rows must be evenly spaced (one tensor map).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/stream.cuh"
#include "kernels/square_matmul/tuning.h"
#include "kernels/square_matmul/wgmma.cuh"
#include "kernels/square_matmul/wgmma_tile.cuh"

namespace mti::square_matmul {
namespace {

template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void wgmma_body(const Args<T>& a, const TmaMaps& maps) {
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, THREADS = Tile::THREADS;
  constexpr int S = Tile::kStages;
  constexpr uint32_t STAGE_BYTES = Tile::STAGE * sizeof(T);
  constexpr uint32_t W_BYTES = BK * BN * sizeof(T);
  static_assert(sizeof(T) == 2, "16-bit operands");

  // [stages][parked tiles but the last][row offsets][full barriers][empty barriers], the
  // stages 1024-byte aligned.
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* const base = smem + (1024 - smem_u32(smem) % 1024) % 1024;
  T* const stages = reinterpret_cast<T*>(base);
  T* const outs = stages + S * Tile::STAGE;
  const int out_ld = (a.col_tiles_per_block - 1) * BN + Tile::kOutPad;
  int64_t* const row_off = reinterpret_cast<int64_t*>(outs + BM * out_ld);
  const uint32_t full0 = smem_u32(row_off + BM), empty0 = full0 + 8 * S;

  const int rank = blockIdx.x % a.cluster;
  const int block = blockIdx.x / a.cluster;  // row block within this launch (the maps' rows)
  const int64_t row0 = (a.first_block + block) * BM;
  const int nrows = static_cast<int>(min(static_cast<int64_t>(BM), a.rows - row0));
  const int col_tiles = (a.k + BN - 1) / BN;
  const int ct_begin = rank * a.col_tiles_per_block;  // < col_tiles: no block is left empty
  const int ct_end = min(col_tiles, ct_begin + a.col_tiles_per_block);
  const int k_tiles = (a.k + BK - 1) / BK;
  const int steps = a.col_tiles_per_block * k_tiles;  // the same in every block of the cluster
  const int real_steps = (ct_end - ct_begin) * k_tiles;
  const int tid = static_cast<int>(threadIdx.x);

  for (int i = tid; i < BM; i += THREADS) row_off[i] = i < nrows ? a.row.offset(row0 + i) : 0;
  if (tid == 0) init_stage_barriers<S>(full0, empty0, Tile::kConsumers * a.cluster);
  // No block loads into, or arrives on, another's barriers before they are initialised.
  cluster_sync();

  const int wg = tid / 128;
  if (wg == 0) {
    setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid == 0) {
      const int slice = BM / a.cluster;  // rows of each x tile this block loads for all
      const uint16_t all = static_cast<uint16_t>((1u << a.cluster) - 1);
      for (int t = 0; t < steps; ++t) {
        const int s = t % S;
        const uint32_t full = full0 + 8 * s, st = smem_u32(base) + s * STAGE_BYTES;
        mbar_wait(empty0 + 8 * s, (t / S & 1) ^ 1);
        const bool real = t < real_steps;
        mbar_arrive_expect_tx(full, real ? STAGE_BYTES : STAGE_BYTES - W_BYTES);
        const int k0 = t % k_tiles * BK, j0 = (ct_begin + t / k_tiles) * BN;
        const uint32_t piece = st + rank * slice * kSwizzleBytes;
        const int r0 = block * BM + rank * slice;
        if (a.cluster > 1)
          tma_load_2d_multicast(piece, &maps.x, k0, r0, full, all);
        else
          tma_load_2d(piece, &maps.x, k0, r0, full);
        if (!real) continue;
        tma_load_w<TRANS, Tile>(st, maps, k0, j0, full);
      }
    }
    __syncwarp();  // lane 0 rejoins its warp before the (warp-aligned) cluster barrier
  } else {
    setmaxnreg_inc<Tile::kConsumerRegs>();
    // Consumer warpgroup c owns rows [64 c, 64 c + 64); see wgmma_m64n256k16 for its thread's
    // values. Thread i < cluster of the warpgroup frees a stage in block i.
    const int c = wg - 1, lane = tid % 32, in_wg = tid % 128;
    const int m = c * 64 + in_wg / 32 * 16 + lane / 4;
    auto release = [&](int t) {
      if (in_wg < a.cluster) mbar_arrive_cluster(empty0 + 8 * (t % S), in_wg);
    };
    float acc[128];
    // Parks the finished tile of output columns [j0, j0 + BN) at dst (pitch ld). (Not through
    // bias_pair, whose test of K per column pair costs time here; these __ldg stay under
    // their test in the PTX, so they are not the hazard bias_pair avoids.)
    auto park = [&](T* dst, int ld, int j0) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const int col = 8 * i + 2 * (lane % 4), j = j0 + col;  // K is even: j + 1 < K too
        float b0 = 0.f, b1 = 0.f;
        if (a.bias && j < a.k) {
          b0 = to_float(__ldg(a.bias + j));
          b1 = to_float(__ldg(a.bias + j + 1));
        }
        *reinterpret_cast<uint32_t*>(dst + m * ld + col) =
            pack2<T>(acc[4 * i] + b0, acc[4 * i + 1] + b1);
        *reinterpret_cast<uint32_t*>(dst + (m + 8) * ld + col) =
            pack2<T>(acc[4 * i + 2] + b0, acc[4 * i + 3] + b1);
      }
    };
    // One group of MMAs stays in flight: step t's stage is freed once step t + 1's MMAs are
    // issued and t's have finished, or at once at the end of a column tile.
    const uint32_t stages_addr = smem_u32(stages);
    for (int t = 0; t < steps; ++t) {
      mbar_wait(full0 + 8 * (t % S), t / S & 1);
      if (t >= real_steps) {  // an x tile of a column tile this block does not have
        release(t);
        continue;
      }
      const int kt = t % k_tiles;
      const uint32_t st = stages_addr + t % S * STAGE_BYTES;
      mma_stage<T, TRANS, Tile>(acc, st, c, kt > 0);
      if (kt == k_tiles - 1) {
        wgmma_wait<0>();
        if (kt > 0) release(t - 1);
        release(t);
        const int ct = t / k_tiles;  // column tile within the block
        if (t + 1 < real_steps) park(outs + ct * BN, out_ld, (ct_begin + ct) * BN);
      } else {
        wgmma_wait<1>();
        if (kt > 0) release(t - 1);
      }
    }
    // The last tile parks in the stages once both warpgroups are done with them; no block
    // writes into them any more (every x tile sent here has landed: it was waited for).
    wgmma_wait<0>();  // done already (the last real step waited), but ptxas cannot tell
    named_barrier(1, 128 * Tile::kConsumers);
    park(stages, Tile::LAST_LD, (ct_end - 1) * BN);
  }
  write_parked<T, Tile>(a, row_off, nrows, outs, out_ld, stages, ct_begin, ct_end,
                        ct_end - ct_begin - 1);
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS, Tile::kBlocksPerSm)
    wgmma_stream_kernel(const __grid_constant__ Args<T> a, const __grid_constant__ TmaMaps maps) {
#if MTI_WGMMA
  wgmma_body<T, TRANS, Tile>(a, maps);
#else
  __trap();  // the launcher runs it only where has_wgmma() says this build has it
#endif
}

// Whether the code loaded for the current device has the sm_90a kernels: only there does
// this kernel have a static shared variable, which cudaFuncGetAttributes reports without a
// launch (so also while a CUDA graph is being captured).
// (Its values depend on the thread, so that the compiler cannot fold the array away.)
__global__ void wgmma_probe_kernel(int* out) {
#if MTI_WGMMA
  __shared__ int marker[32];
  marker[threadIdx.x % 32] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = marker[(threadIdx.x + 1) % 32];
#endif
}

}  // namespace

bool has_wgmma() {
  static std::atomic<int> cache[kMaxDevices];
  return once_per_device(cache, [](int) {
           cudaFuncAttributes attr{};
           return cudaFuncGetAttributes(&attr, wgmma_probe_kernel) == cudaSuccess &&
                  attr.sharedSizeBytes > 0;
         }) == 1;
}

struct WgmmaStream {
  using Tiles = WgmmaTiles;
  template <typename T, bool TRANS, class Tile>
  static auto kernel() {
    return &wgmma_stream_kernel<T, TRANS, Tile>;
  }
};

MTI_INSTANTIATE_STREAM(WgmmaStream, __half)
MTI_INSTANTIATE_STREAM(WgmmaStream, __nv_bfloat16)

}  // namespace mti::square_matmul
