// The streaming kernel on mma.sync (fp16/bf16, sm_90; stream.cuh).
//
// A cluster of `cluster` blocks owns BM whole rows. Block r of the cluster computes output
// column tiles [r * tpc, (r + 1) * tpc) of those rows (tpc = a.col_tiles_per_block) as an
// ordinary tiled GEMM: (BM x kBK) tiles of x and (kBK x BN) tiles of W both stream from L2
// through a kStages-deep cp.async pipeline, and each finished BM x BN tile (bias added,
// rounded to T) is parked in shared memory, the last one in the pipeline buffers once the
// main loop no longer needs them. Only after a cluster barrier, when every block of the
// cluster has read all of the rows' inputs it needs, are the parked tiles written over x.
// So shared memory holds BM x (K / cluster - BN) outputs instead of BM x K inputs: BM = 128
// fits any K up to 8 * 768 (bf16, 227 KB), and each 24 KB pair of tiles read from L2 feeds
// BM * BN * kBK multiply-adds (85 flops per byte) whatever K is, where the staging kernel
// holds 24 rows per block at K = 4096 (24 flops per byte of W).
//
// One block per multiprocessor (8 warps), so the warps hide latency by independent work
// rather than by numbers: each warp computes a 64-column slice, MT m16 tiles by 8 n8 tiles,
// which per k16 step is 4 * MT MMAs on MT + 4 ldmatrix.x4 (twice the MMAs per ldmatrix of
// a 32-column slice, and a third less shared memory read per MMA), and the fragments of the
// next k16 step load while this step's MMAs run, across W tiles too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/mma_sync.cuh"
#include "kernels/square_matmul/stream.cuh"
#include "kernels/square_matmul/tuning.h"

namespace mti::square_matmul {

// Pipeline stages of x and W tiles, the parked outputs after them; 8 warps in a 2 x 4 grid,
// each computing MT m16 tiles (16 rows each) by NT n8 tiles (64 columns).
template <int MT_>
struct StreamTile {
  static constexpr int MT = MT_;
  static constexpr int NT = 8;
  static constexpr int WARPS_R = 2;
  static constexpr int WARPS_C = 4;
  static constexpr int THREADS = 32 * WARPS_R * WARPS_C;
  static constexpr int BM = 16 * MT * WARPS_R;
  static constexpr int BN = 8 * NT * WARPS_C;  // 256, which plan_stream's costs assume
  // x tile [BM][kBK] swizzled like a transposed W tile (w_index<kBK>), then the W tile.
  static constexpr int X_TILE = BM * kBK;
  static constexpr int STAGE = X_TILE + kBK * BN;
  // Parked rows: a pitch of a multiple of BN plus 8 elements, 16 bytes past a multiple of 128
  // bytes, so the 8 rows one accumulator store writes start in distinct bank quads.
  static constexpr int kOutPad = 8;
  static constexpr int LAST_LD = BN + kOutPad;  // pitch of the last tile, in the stages
  // The accumulators and two k16 steps of fragments take 160-240 registers per thread, so
  // the register file holds one block.
  static constexpr int kBlocksPerSm = 1;
  static constexpr int kStages = square_matmul::kStages;
  static constexpr int kMaxCluster = kStreamMaxCluster;
  static constexpr bool kTma = false;   // cp.async loads: every block loads all of each x tile
  static constexpr int kSmemSlack = 0;  // bytes of dynamic shared memory spent on alignment
  static_assert(X_TILE / 8 % THREADS == 0, "whole 16-byte chunks of x per thread");
  static_assert(kStages * STAGE >= BM * LAST_LD, "the last tile parks in the stages");
  static_assert(kBK % 32 == 0, "fragment buffers alternate by k16 step parity");
};

namespace {

// Needs a.x_vec and a.w_vec (16-byte chunks throughout), so K is a multiple of 8.
template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void stream_body(const Args<T>& a) {
  constexpr int BM = Tile::BM, BN = Tile::BN, MT = Tile::MT, NT = Tile::NT;
  constexpr int THREADS = Tile::THREADS, STAGE = Tile::STAGE;
  constexpr int X_CHUNKS = Tile::X_TILE / 8 / THREADS;  // per thread and tile
  constexpr int KS = kBK / 16;                          // k16 steps per tile

  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* row_off = reinterpret_cast<int64_t*>(smem);
  T* stages = reinterpret_cast<T*>(smem + BM * sizeof(int64_t));
  T* outs = stages + kStages * STAGE;  // all column tiles but the last
  const int out_ld = (a.col_tiles_per_block - 1) * BN + Tile::kOutPad;

  const int rank = blockIdx.x % a.cluster;
  const int64_t row0 = (a.first_block + blockIdx.x / a.cluster) * BM;
  const int nrows = static_cast<int>(min(static_cast<int64_t>(BM), a.rows - row0));
  const int col_tiles = (a.k + BN - 1) / BN;
  const int ct_begin = rank * a.col_tiles_per_block;  // < col_tiles: no block is left empty
  const int ct_end = min(col_tiles, ct_begin + a.col_tiles_per_block);
  const int k_tiles = a.kpad / kBK;
  const int tiles = (ct_end - ct_begin) * k_tiles;

  for (int i = threadIdx.x; i < BM; i += THREADS)
    row_off[i] = i < nrows ? a.row.offset(row0 + i) : 0;
  __syncthreads();

  // This thread's x chunks: tile rows xr + i * (THREADS / 4), columns [xc, xc + 8); rows past
  // the last are zero-filled (src nullptr).
  const int xr = threadIdx.x / 4, xc = threadIdx.x % 4 * 8;
  const T* xsrc[X_CHUNKS];
  int xdst[X_CHUNKS];
#pragma unroll
  for (int i = 0; i < X_CHUNKS; ++i) {
    const int r = xr + i * (THREADS / 4);
    xsrc[i] = r < nrows ? a.x + row_off[r] + xc : nullptr;
    xdst[i] = w_index<kBK>(r, xc);
  }
  // Loads the tiles in order, one per call: stage `next` % kStages gets x columns
  // [next_k0, next_k0 + kBK) and the W tile of output columns [next_j0, next_j0 + BN).
  int next = 0, next_k0 = 0, next_j0 = ct_begin * BN;
  auto load_next = [&] {
    T* st = stages + next % kStages * STAGE;
#pragma unroll
    for (int i = 0; i < X_CHUNKS; ++i) {
      const bool in = xsrc[i] != nullptr && next_k0 + xc < a.k;
      copy16(st + xdst[i], in ? xsrc[i] + next_k0 : a.w, in);
    }
    load_w_tile<T, TRANS, Tile>(a, st + Tile::X_TILE, next_j0, next_k0);
    ++next;
    next_k0 += kBK;
    if (next_k0 == a.kpad) {
      next_k0 = 0;
      next_j0 += BN;
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load_next();
    cp_async_commit();
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_r = warp / Tile::WARPS_C, warp_c = warp % Tile::WARPS_C;
  // ldmatrix roles: lane supplies the address of row (lane & 7) of 8x8 matrix (lane >> 3).
  // A = x rows, stored [m][k]: matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
  // (m 8-15, k 8-15), the m16n8k16 A fragment's order. B = Wv, columns n: matrices
  // (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) give two n8 tiles' B
  // fragments. This lane's rows, as byte offsets in a stage: a 64-byte-row tile's swizzle
  // repeats every 16 rows, so its m16 (x) or n16 (transposed W) tiles lie whole tiles apart,
  // one offset per k16 step; a [kBK][BN] W tile's swizzle repeats every 8 rows, so its k16
  // steps lie 16 rows apart, one offset per n16 tile.
  const int mi = lane >> 3, mr = lane & 7;
  constexpr int B_OFFS = TRANS ? KS : NT / 2;
  uint32_t a_off[KS], b_off[B_OFFS];
#pragma unroll
  for (int s = 0; s < KS; ++s)
    a_off[s] =
        sizeof(T) * w_index<kBK>(warp_r * MT * 16 + (mi & 1) * 8 + mr, s * 16 + (mi >> 1) * 8);
#pragma unroll
  for (int i = 0; i < B_OFFS; ++i) {
    // Transposed: W^T row n + mr (+ 16 np), k16 step i; else k row mr (+ 16 s), n16 tile i.
    const int n = warp_c * NT * 8 + (mi >> 1) * 8;
    b_off[i] = sizeof(T) * (Tile::X_TILE + (TRANS ? w_index<kBK>(n + mr, i * 16 + (mi & 1) * 8)
                                                  : w_index<BN>((mi & 1) * 8 + mr, n + i * 16)));
  }
  const uint32_t stages_addr = smem_u32(stages);
  constexpr uint32_t STAGE_BYTES = STAGE * sizeof(T);
  // Fragments of k16 step s of the stage at shared address st.
  auto load_frags = [&](uint32_t st, int s, uint32_t (&af)[MT][4], uint32_t (&bf)[NT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldsm_x4<false>(af[mt], st + a_off[s] + mt * 16 * kBK * sizeof(T));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t r[4];
      if constexpr (TRANS)  // stored [n][k]
        ldsm_x4<false>(r, st + b_off[s] + np * 16 * kBK * sizeof(T));
      else  // stored [k][n]: transpose
        ldsm_x4<true>(r, st + b_off[np] + s * 16 * BN * sizeof(T));
      bf[2 * np][0] = r[0];
      bf[2 * np][1] = r[1];
      bf[2 * np + 1][0] = r[2];
      bf[2 * np + 1][1] = r[3];
    }
  };

  float acc[MT][NT][4] = {};
  // Parks the finished tile of output columns [j0, j0 + BN) at dst (pitch ld) and clears the
  // accumulators. Accumulator (mt, nt): c[0..1] at (m = g, n = 2q, 2q + 1), c[2..3] at
  // m = g + 8.
  auto park = [&](T* dst, int ld, int j0) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = warp_c * NT * 8 + nt * 8 + 2 * q;
      const float2 b = bias_pair(a, j0 + col);  // K is even: j + 1 < K with j
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int m = (warp_r * MT + mt) * 16 + g;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          *reinterpret_cast<uint32_t*>(dst + (m + 8 * h) * ld + col) =
              pack2<T>(acc[mt][nt][2 * h] + b.x, acc[mt][nt][2 * h + 1] + b.y);
          acc[mt][nt][2 * h] = acc[mt][nt][2 * h + 1] = 0.f;
        }
      }
    }
  };

  // Main loop. Stage t % kStages is read by the fragment loads of iterations (t - 1, KS - 1)
  // and (t, s < KS - 1), and refilled (with tile t + kStages) at (t + 1, 0), after the
  // barrier of (t, KS - 1) that every warp passes only when done with those loads.
  uint32_t af[2][MT][4], bf[2][NT][2];
  cp_async_wait<kStages - 2>();
  __syncthreads();  // tile 0 landed
  load_frags(stages_addr, 0, af[0], bf[0]);
  int kt = 0, parked = 0;  // k tile of t; column tiles parked so far
  for (int t = 0; t < tiles; ++t) {
    const uint32_t st = stages_addr + t % kStages * STAGE_BYTES;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      if (s == 0) {
        if (next < tiles) load_next();  // tile t + kStages - 1
        cp_async_commit();
      }
      if (s + 1 < KS) {
        load_frags(st, s + 1, af[(s + 1) % 2], bf[(s + 1) % 2]);
      } else if (t + 1 < tiles) {
        // Tile t + 1 landed for every thread (the wait leaves tiles up to t + kStages - 1 in
        // flight). The barrier comes after step 0's MMAs were issued, so they cover it.
        cp_async_wait<kStages - 2>();
        __syncthreads();
        load_frags(stages_addr + (t + 1) % kStages * STAGE_BYTES, 0, af[0], bf[0]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816<T>(acc[mt][nt], af[s % 2][mt], bf[s % 2][nt]);
    }
    if (++kt == k_tiles && t + 1 < tiles) {
      park(outs + parked * BN, out_ld, (ct_begin + parked) * BN);
      ++parked;
      kt = 0;
    }
  }

  // Every read of x was a cp.async that a wait completed before its fragments loaded; the
  // last tile parks in the stages once every warp is done with them.
  __syncthreads();
  park(stages, Tile::LAST_LD, (ct_end - 1) * BN);
  write_parked<T, Tile>(a, row_off, nrows, outs, out_ld, stages, ct_begin, ct_end, parked);
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS, Tile::kBlocksPerSm)
    stream_kernel(const __grid_constant__ Args<T> a) {
#if defined(__CUDA_ARCH__)
  // Clusters need sm_90; the launcher picks this kernel only there.
  constexpr bool kSupported = __CUDA_ARCH__ >= 900;
#else
  constexpr bool kSupported = true;
#endif
  if constexpr (kSupported)
    stream_body<T, TRANS, Tile>(a);
  else
    __trap();
}

}  // namespace

struct MmaStream {
  using Tiles = StreamTiles;
  template <typename T, bool TRANS, class Tile>
  static auto kernel() {
    return &stream_kernel<T, TRANS, Tile>;
  }
};

MTI_INSTANTIATE_STREAM(MmaStream, __half)
MTI_INSTANTIATE_STREAM(MmaStream, __nv_bfloat16)

}  // namespace mti::square_matmul
