// The handshake kernel (fp16/bf16, sm_90a builds on sm_90; the default path's, as it needs a
// few bytes of counters): an ordinary GEMM whose epilogue writes over x, made safe by a
// handshake per row block instead of by keeping rows or outputs on chip.
//
// A row block of BM rows has T = ceil(K / BN) output tiles. A persistent grid of G CTAs, G a
// multiple of T, all resident at once (cooperative launch), takes tile i (row block i / T,
// column tile i % T) in CTA i % G, its n-th tile in the n-th round: so the T tiles of a row
// block run at the same time, in T different CTAs, and a CTA always computes the same column
// tile (its W columns stay hot in L2 for the G / T CTAs that share them). (A G that is not a
// multiple of T would split a row block between rounds, half of it waiting a whole round for
// the other half.) A tile is the warpgroup kernel's (TMA-fed m64n256k16 MMAs of two consumer
// warpgroups, a producer warp kStages steps ahead, going on into the next tile). When a
// tile's MMAs are done, every x element of the row block that the tile reads has been read:
// the CTA adds one to the row block's counter (release, GPU scope). It then rounds the
// accumulators (plus bias) into registers and starts the next tile's MMAs. Between the next
// tile's first K steps, while their MMAs run, it stages the held tile in shared memory in
// kOutParts parts (see HandshakeTile), the first once the counter has reached T (acquire): no
// CTA reads the row block's x any more, so TMA stores write each part over x,
// asynchronously. (Staged before the next tile's MMAs, the epilogue would hold both MMA
// warpgroups up; written from the registers straight to x, every CTA's stores would come at
// once, at the end of each round, and the MMAs wait for them.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/tuning.h"
#include "kernels/square_matmul/wgmma.cuh"
#include "kernels/square_matmul/wgmma_tile.cuh"

namespace mti::square_matmul {
namespace {

// The handshake kernel's tiles, in clusters of CLUSTER CTAs: the warpgroup kernel's with
// kHandshakeStages stages and beside them a staging tile of kOutBoxes boxes of BK output
// columns, which stages an output tile in kOutParts parts (each part after the last one's
// stores have read the staging tile).
template <int CLUSTER>
struct HandshakeTile : WgmmaTile<kHandshakeStages> {
  static constexpr int kWParts = CLUSTER;  // CTAs per cluster, which share W tiles
  static constexpr int kOutBoxes = kHandshakeOutBoxes;
  static constexpr int kOutParts = BN / BK / kOutBoxes;
  static_assert(kOutParts * kOutBoxes * BK == BN, "whole parts");
  static constexpr size_t kSmem =
      kSmemSlack + (kStages * STAGE + BM * BK * kOutBoxes) * 2 + BN * sizeof(float);
};
static_assert(HandshakeTile<2>::kSmem <= kSm90SmemOptin, "fits an sm_90 block's shared memory");

// A counter in global memory that orders CTAs of a grid (the handshake kernel): the add
// releases the adding thread's earlier accesses at GPU scope (and, through the block
// barrier before it, its block's), the load acquires the adds it sees.
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
#if __CUDA_ARCH__ >= 700
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
#endif
}
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v = 0;
#if __CUDA_ARCH__ >= 700
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void handshake_body(const Args<T>& a, const TmaMaps& maps,
                                               int* counters) {
  constexpr int BM = Tile::BM, BN = Tile::BN, BK = Tile::BK, S = Tile::kStages;
  constexpr uint32_t STAGE_BYTES = Tile::STAGE * sizeof(T);
  constexpr uint32_t BOX_BYTES = BM * kSwizzleBytes;  // BK columns of the staging tile
  static_assert(sizeof(T) == 2 && BK * sizeof(T) == kSwizzleBytes, "16-bit operands");

  // [stages][staging tile: kOutBoxes boxes of BM rows][bias: BN floats][full barriers][empty
  // barriers], the stages and the staging tile 1024-byte aligned (swizzle). The staging boxes
  // are laid out as x's tensor map loads them.
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* const base = smem + (1024 - smem_u32(smem) % 1024) % 1024;
  const uint32_t stages_addr = smem_u32(base);
  unsigned char* const out = base + S * STAGE_BYTES;
  const uint32_t out_addr = smem_u32(out);
  float* const bias = reinterpret_cast<float*>(out + Tile::kOutBoxes * BOX_BYTES);
  const uint32_t full0 = smem_u32(bias + BN), empty0 = full0 + 8 * S;

  // Clusters of C CTAs take C row blocks at a time (a group) and share each W tile: CTA
  // `rank` of a cluster loads part `rank` of it for all (tma_load_w).
  constexpr int C = Tile::kWParts;
  constexpr uint32_t W_BYTES = STAGE_BYTES - Tile::A_BYTES;
  const int rank = static_cast<int>(blockIdx.x) % C;
  const int64_t cluster_id = blockIdx.x / C, clusters = gridDim.x / C;
  const int col_tiles = (a.k + BN - 1) / BN;
  const int k_tiles = (a.k + BK - 1) / BK;
  const int64_t row_blocks = (a.rows + BM - 1) / BM;
  const int64_t tiles = (row_blocks + C - 1) / C * col_tiles;    // of groups
  const int j0 = static_cast<int>(cluster_id % col_tiles) * BN;  // the same in every round
  const int tid = static_cast<int>(threadIdx.x);
  // This CTA's row block in group tile i (with C > 1, past the last one for the last CTA of a
  // last group that has fewer: it loads and shares its part of W all the same).
  auto row_block = [&](int64_t i) { return i / col_tiles * C + rank; };
  // The CTA's steps (k tiles of its tiles, in order: the stages are a ring across tiles): at
  // most (row_blocks + 1) * k_tiles (G >= T), about M * K / 8192, an int for any x of fewer
  // than 2^44 elements.
  const int steps =
      cluster_id < tiles ? static_cast<int>((tiles - 1 - cluster_id) / clusters + 1) * k_tiles : 0;
  // The producer's next step t: k tile kt of the CTA's tile i, of row block rb. Advanced in
  // place: computed from t by 64-bit divisions, the step's indices would hold the loads up.
  int t_next = 0, kt_next = 0;
  int64_t i_next = cluster_id, rb_next = row_block(i_next);
  // Waits for the next step's stage to be free, then loads its x and W tiles into it.
  auto load_next = [&]() {
    const int s = t_next % S, k0 = kt_next * BK;
    const uint32_t full = full0 + 8 * s, st = stages_addr + s * STAGE_BYTES;
    const bool rows = rb_next < row_blocks;
    mbar_wait(empty0 + 8 * s, (t_next / S & 1) ^ 1);
    mbar_arrive_expect_tx(full, rows ? STAGE_BYTES : W_BYTES);
    if (rows) tma_load_2d(st, &maps.x, k0, static_cast<int>(rb_next) * BM, full);
    tma_load_w<TRANS, Tile>(st, maps, k0, j0, full, rank);
    ++t_next;
    if (++kt_next == k_tiles) {
      kt_next = 0;
      i_next += clusters;
      rb_next = row_block(i_next);
    }
  };

  // The row blocks' counters start at zero, and the tiles leave them so (store_held_part).
  int* const block_counters = counters + a.first_block;
  // The CTA's bias columns (zeros without a bias or past K), read once: every round's tiles
  // have the same columns, and the epilogue then waits on no global load.
  for (int j = tid; j < BN; j += Tile::THREADS)
    bias[j] = a.bias != nullptr && j0 + j < a.k ? to_float(a.bias[j0 + j]) : 0.f;
  // A stage is empty once both consumer warpgroups of every CTA it was loaded into are done
  // with it.
  if (tid == 0) init_stage_barriers<S>(full0, empty0, Tile::kConsumers * C);
  // No CTA of the cluster loads into another's stages before their barriers are initialised.
  if constexpr (C > 1) cluster_sync();
  if (tid == 0)
    while (t_next < std::min(steps, S)) load_next();  // every stage is free
  __syncthreads();  // the stage barriers are initialised, the bias columns in

  const int wg = tid / 128;
  if (wg == 0) {
    setmaxnreg_dec<Tile::kProducerRegs>();
    if (tid == 0)
      while (t_next < steps) load_next();
    __syncwarp();
    // The cluster's other CTAs may load into this one's stages until they are done.
    if constexpr (C > 1) cluster_sync();
    return;
  }

  setmaxnreg_inc<Tile::kConsumerRegs>();
  // Consumer warpgroup c owns rows [64 c, 64 c + 64) of a tile; see wgmma_m64n256k16 for its
  // thread's values. One thread per warpgroup frees a stage; thread 128 (the leader) does
  // the handshake and the stores.
  const int c = wg - 1, lane = tid % 32, in_wg = tid % 128;
  const int m = c * 64 + in_wg / 32 * 16 + lane / 4;
  const bool leader = tid == 128;
  // Thread r < C of each warpgroup frees the stage in CTA r of the cluster.
  auto release = [&](int t) {
    if constexpr (C > 1) {
      if (in_wg < C) mbar_arrive_cluster(empty0 + 8 * (t % S), in_wg);
    } else {
      if (in_wg == 0) mbar_arrive(empty0 + 8 * (t % S));
    }
  };
  float acc[128];
  int t = 0;
  // The last tile's output, rounded (plus bias) into pairs, while the next tile's first MMAs
  // run: held[2 n + h] holds columns 8 n + 2 (lane % 4) + {0, 1} of row m + 8 h.
  uint32_t held[BN / 4];
  int* held_counter = nullptr;  // the held tile's row block's counter (nullptr: none held)
  int held_r0 = 0;
  // The leader's second add to held_counter, past its wait: the last tile's (2T - 1) resets
  // the counter, which no tile reads any more, so that every counter is zero again when the
  // kernel ends. Tested only when the tile's MMAs are done, so that the add's round trip does
  // not hold the leader's warpgroup up.
  int ticket = 0;
  auto reset_if_last = [&]() {
    if (held_counter != nullptr && ticket == 2 * col_tiles - 1) atomicExch(held_counter, 0);
  };
  // Stages part `part` of the held tile and stores it over x once its row block is read.
  auto store_held_part = [&](int part) {
    if (leader) bulk_wait_read();  // the last part's stores have read the staging tile
    named_barrier(1, 128 * Tile::kConsumers);
#pragma unroll
    for (int q = 0; q < Tile::kOutBoxes * BK / 8; ++q) {
      // Columns 8n + 2 (lane % 4) + {0, 1} of the tile: 16-byte chunk n % BK/8 of a row of
      // box q / (BK/8), swizzled by the row (the 8 rows a warp writes at once fall in 8
      // distinct chunks).
      const int n = part * Tile::kOutBoxes * BK / 8 + q;
      unsigned char* const box = out + q / (BK / 8) * BOX_BYTES + 4 * (lane % 4);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m + 8 * h;
        *reinterpret_cast<uint32_t*>(box + r * kSwizzleBytes + ((n % (BK / 8)) ^ (r % 8)) * 16) =
            held[2 * n + h];
      }
    }
    fence_proxy_async_shared();
    named_barrier(1, 128 * Tile::kConsumers);
    if (leader) {
      if (part == 0) {
        while (ld_acquire_gpu(held_counter) < col_tiles) __nanosleep(32);
        ticket = atomicAdd(held_counter, 1);
      }
      fence_proxy_async_global();
      for (int box = 0; box < Tile::kOutBoxes; ++box) {
        const int col = j0 + (part * Tile::kOutBoxes + box) * BK;
        if (col < a.k) tma_store_2d(&maps.x, col, held_r0, out_addr + box * BOX_BYTES);
      }
      bulk_commit();
    }
  };
  // K tile kt of a tile. One group of MMAs stays in flight: step t's stage is freed once step
  // t + 1's MMAs are issued and t's have finished, the tile's last once all have.
  auto mma_step = [&](int kt) {
    mbar_wait(full0 + 8 * (t % S), t / S & 1);
    mma_stage<T, TRANS, Tile>(acc, stages_addr + t % S * STAGE_BYTES, c, kt > 0);
    wgmma_wait<1>();
    if (kt > 0) release(t - 1);
    ++t;
  };
  for (int64_t i = cluster_id; i < tiles; i += clusters) {
    const int64_t rb = row_block(i);
    if (rb >= row_blocks) {  // no rows: this CTA's stages only pass its part of W through
      for (int kt = 0; kt < k_tiles; ++kt, ++t) {
        mbar_wait(full0 + 8 * (t % S), t / S & 1);
        release(t);
      }
      continue;
    }
    // The held tile's parts go out between this tile's first K steps, while their MMAs run.
    int kt = 0;
#pragma unroll
    for (int part = 0; part < Tile::kOutParts; ++part) {
      if (kt < k_tiles) mma_step(kt++);
      if (held_counter != nullptr) store_held_part(part);
    }
    for (; kt < k_tiles; ++kt) mma_step(kt);
    wgmma_wait<0>();
    release(t - 1);
    // Both warpgroups' MMAs are done: the row block is read.
    named_barrier(1, 128 * Tile::kConsumers);
    if (leader) reset_if_last();
    held_counter = block_counters + rb;
    held_r0 = static_cast<int>(rb) * BM;
    if (leader) red_release_gpu_add(held_counter, 1);
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      const float2 b = *reinterpret_cast<const float2*>(bias + 8 * n + 2 * (lane % 4));
#pragma unroll
      for (int h = 0; h < 2; ++h)
        held[2 * n + h] = pack2<T>(acc[4 * n + 2 * h] + b.x, acc[4 * n + 2 * h + 1] + b.y);
    }
  }
  if (held_counter != nullptr)
#pragma unroll
    for (int part = 0; part < Tile::kOutParts; ++part) store_held_part(part);
  if (leader) reset_if_last();
  if (leader) bulk_wait();
  // The cluster's other CTAs may arrive on this one's barriers until they are done.
  if constexpr (C > 1) cluster_sync();
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS, 1)
    handshake_kernel(const __grid_constant__ Args<T> a, const __grid_constant__ TmaMaps maps,
                     int* counters) {
#if MTI_WGMMA
  handshake_body<T, TRANS, Tile>(a, maps, counters);
#else
  __trap();  // the launcher runs it only where has_wgmma() says this build has it
#endif
}

// Calls f(Tile{}) with the tile for clusters of `cluster` CTAs (2, else 1).
template <class F>
auto with_cluster(int cluster, F&& f) {
  return cluster == 2 ? f(HandshakeTile<2>{}) : f(HandshakeTile<1>{});
}

// A cooperative launch of `grid` CTAs of Tile's handshake kernel, in its clusters (the
// cluster attribute only where they have more than one CTA).
template <class Tile>
cudaLaunchConfig_t launch_config(unsigned grid, cudaStream_t stream,
                                 cudaLaunchAttribute (&attrs)[2]) {
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  attrs[1] = cluster_dims(Tile::kWParts);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(Tile::THREADS);
  cfg.dynamicSmemBytes = Tile::kSmem;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = Tile::kWParts > 1 ? 2 : 1;
  return cfg;
}

// A row block's output tiles (T in the kernel's comment), and the row blocks of `rows` rows,
// one counter each; BN and BM are the same in every cluster size.
int col_tiles(int k) { return ceil_div(k, HandshakeTile<1>::BN); }
int64_t row_blocks(int64_t rows) { return ceil_div(rows, int64_t{HandshakeTile<1>::BM}); }

// The kernel's grid (in CTAs) on the current device for K: as many clusters of
// Tile::kWParts CTAs as are resident at once, rounded down to a multiple of the column tiles
// (0: fewer fit than a row block has tiles). Occupancy asked once per device, after raising
// the kernel's shared memory limit there (which launch relies on).
template <typename T, bool TRANS, class Tile>
int grid(int k) {
  constexpr int C = Tile::kWParts;
  static std::atomic<int> cache[kMaxDevices];  // resident clusters
  const int resident = once_per_device(cache, [](int) {
    DeviceInfo d;
    return current_device(&d) == cudaSuccess
               ? occupancy_units(&handshake_kernel<T, TRANS, Tile>, Tile::THREADS, C, Tile::kSmem,
                                 d.sm_count, 0, /*cooperative=*/true)
               : 0;
  });
  const int tiles = col_tiles(k);
  return resident / tiles * tiles * C;
}

// Launches the kernel on a grid of c.grid CTAs in launches of at most INT_MAX / BM - 1 row
// blocks, so that the tensor maps' row coordinates stay 32-bit.
template <typename T, bool TRANS, class Tile>
cudaError_t launch(Args<T> a, const HandshakeConfig& c, int* counters, cudaStream_t stream) {
  const int64_t tiles = col_tiles(a.k);
  const int64_t blocks_in_all = row_blocks(a.rows), total_rows = a.rows;
  constexpr int64_t kPerLaunch = INT_MAX / Tile::BM - 1;
  // The kernel's shared memory limit was raised by grid(), for this device.
  cudaError_t err = cudaSuccess;
  for (int64_t first = 0; err == cudaSuccess && first < blocks_in_all; first += kPerLaunch) {
    const int64_t blocks = std::min(blocks_in_all - first, kPerLaunch);
    const int64_t row0 = first * Tile::BM;
    a.first_block = first;
    a.rows = std::min(total_rows - row0, blocks * Tile::BM);  // this launch's
    TmaMaps maps;
    err = make_maps<T, TRANS, Tile>(a, row0, a.rows, 1, &maps);
    if (err != cudaSuccess) break;
    constexpr int C = Tile::kWParts;
    const int64_t ctas = std::min<int64_t>(c.grid, ceil_div(blocks, int64_t{C}) * tiles * C);
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = launch_config<Tile>(static_cast<unsigned>(ctas), stream, attrs);
    err = cudaLaunchKernelEx(&cfg, &handshake_kernel<T, TRANS, Tile>, a, maps, counters);
  }
  return err == cudaSuccess ? cudaGetLastError() : err;
}

}  // namespace

// Where it applies at all (select.cu): a grid that holds a row block's tiles, and tiles
// enough to keep at least half of the multiprocessors busy (fewer rows are left to cuBLAS,
// which splits them finer).
template <typename T>
HandshakeConfig handshake_config(const Args<T>& a, bool trans, const DeviceInfo& d) {
  HandshakeConfig c;
  c.cluster = tuned(kHandshakeCluster, tuning_key(d, sizeof(T), a.k)) == 2 ? 2 : 1;
  c.grid = with_cluster(c.cluster, [&](auto tile) {
    using Tile = decltype(tile);
    return trans ? grid<T, true, Tile>(a.k) : grid<T, false, Tile>(a.k);
  });
  const int64_t blocks = row_blocks(a.rows);
  if (c.grid > 0 && 2 * blocks * col_tiles(a.k) >= d.sm_count) c.counters = blocks;
  return c;
}

template <typename T>
cudaError_t launch_handshake(const Args<T>& a, bool trans, const HandshakeConfig& c, int* counters,
                             bool counters_zero, cudaStream_t stream) {
  // Zeroed on the stream rather than by the kernel's CTAs before a grid barrier, which cost
  // more than this memset.
  if (!counters_zero) {
    const cudaError_t err = cudaMemsetAsync(counters, 0, c.counters * sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  return with_cluster(c.cluster, [&](auto tile) {
    using Tile = decltype(tile);
    return trans ? launch<T, true, Tile>(a, c, counters, stream)
                 : launch<T, false, Tile>(a, c, counters, stream);
  });
}

#define MTI_INSTANTIATE(T)                                                                     \
  template HandshakeConfig handshake_config<T>(const Args<T>&, bool, const DeviceInfo&);       \
  template cudaError_t launch_handshake<T>(const Args<T>&, bool, const HandshakeConfig&, int*, \
                                           bool, cudaStream_t);
MTI_INSTANTIATE(__half)
MTI_INSTANTIATE(__nv_bfloat16)
#undef MTI_INSTANTIATE

}  // namespace mti::square_matmul
