// Zero-workspace square matmul: x <- x @ W (or x @ W^T) + bias, written over x.
//
// A thread block owns BM whole rows of x. It copies them (all K columns) into shared memory,
// and only then starts writing: every output element of its rows is computed from the staged
// copy, so the results can go straight over x in global memory. Blocks own disjoint rows, so
// no block reads what another writes. When there are too few row blocks to fill the GPU,
// several blocks share a row block, each computing a slice of the output columns; they are
// launched cooperatively and wait for each other (grid sync) between staging and writing.
//
// The rows' output is produced column tile by column tile: a BN-column tile accumulates over
// K in kBK steps, each step a (kBK x BN) tile of W staged in shared memory.
//  - fp16/bf16 (sm_80+, fp16 also sm_75): tensor cores, mma.sync m16n8k16 with fp32
//    accumulators, W tiles fed by a kStages-deep cp.async pipeline. The MMA computes the
//    transposed product out^T = Wv^T x^T: W supplies the 16-row A operand and x the 8-wide B
//    operand, so a block may own any multiple of 8 rows. Every block streams all of W from
//    L2, so the rows per block (as many as shared memory holds) set the arithmetic per byte
//    of W, which bounds the speed at large K.
//  - float (and fp16/bf16 where the tensor-core path is missing): fp32 FMA tiles.
//
// On sm_90, fp16/bf16 with 16-byte aligned rows take the streaming kernel instead (below):
// a thread-block cluster shares a row block, each block parking its slice of the outputs in
// shared memory until a cluster barrier says all of the rows' inputs have been read, so a
// block need not hold whole input rows and does many more rows per W tile. Builds for sm_90a
// run it on the warpgroup MMA (wgmma) instead of mma.sync, fed by the TMA, where x's rows are
// evenly spaced.
#include "kernels/square_matmul.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/mbarrier.cuh"
#include "kernels/wgmma.cuh"

namespace mti {
namespace {

namespace cg = cooperative_groups;

constexpr int kBK = 32;      // k extent of one W tile
constexpr int kStages = 4;   // W tiles in flight in the tensor-core kernel
constexpr int kMmaXPad = 8;  // staged x row pitch = kpad + pad (see MmaTile, FmaTile)
constexpr int kFmaXPad = 0;

__host__ __device__ constexpr int round_up(int a, int b) { return (a + b - 1) / b * b; }

template <typename T>
struct Args {
  T* x;
  RowIndexer row;
  int64_t rows;
  int64_t first_block;      // row block of blockIdx.x == 0 (grids are split at 2^31 - 1 blocks)
  int k;
  int kpad;                 // K rounded up to kBK: the staged rows are zero beyond K
  int ldx;                  // pitch of the staged rows in shared memory, in elements
  const T* w;
  const T* bias;            // nullptr: no bias
  int col_tiles_per_block;  // column tiles per block: gridDim.y slices them (staging kernels)
                            // or the blocks of a cluster do (streaming kernel)
  int cluster;              // blocks per cluster, which share a row block (streaming kernel)
  bool x_vec;               // x rows start 16-byte aligned and K fills whole 16-byte chunks
  bool w_vec;               // W likewise
  bool grid_sync;           // blocks share row blocks: all stage before any writes
};

template <typename T>
__device__ __forceinline__ T zero() {
  return from_float<T>(0.f);
}

// ---------------------------------------------------------------------------------------
// Shared by both kernels: stage the block's rows and place the block in the grid.

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
// the null test (the handshake kernel's first form, so compiled, read address 0x12 on an
// H100).
template <typename T>
__device__ __forceinline__ float2 bias_pair(const Args<T>& a, int j) {
  if (a.bias == nullptr || j >= a.k) return make_float2(0.f, 0.f);
  return make_float2(to_float(a.bias[j]), to_float(a.bias[j + 1]));
}

// ---------------------------------------------------------------------------------------
// Tensor-core kernel (fp16/bf16).

// ldmatrix from a shared-memory address (smem_u32): lane l supplies row l % 8 of matrix l / 8.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// d += a (16x16, row-major fragment) * b (16x8, column-major fragment), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // sm_75 has no k16 shape: two k8 steps, a[0..1]/b[0] covering k 0-7 and a[2..3]/b[1] 8-15.
  static_assert(std::is_same_v<T, __half>, "bf16 tensor cores need sm_80");
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[2]), "r"(a[3]), "r"(b[1]));
#endif
}

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
  // Streaming one W tile from L2 costs about what kWCost rows of tensor-core MMAs on it do
  // (an SM takes ~32 bytes per clock from L2 and does ~1024 flops per clock in mma.sync).
  static constexpr int kWCost = 32;
  // W tile, unpadded and swizzled (see w_index): [BN][kBK] when transposed (a row of W^T is
  // a row of W), else [kBK][BN].
  __host__ __device__ static constexpr int w_tile_elems(bool) { return BN * kBK; }
  static_assert(NT >= 1 && BM % (8 * WARPS_R) == 0, "whole n8 tiles per warp");
};

// Element offset of (row, col) in a swizzled tile of COLS 16-bit columns (row-major): the
// 16-byte chunk index is XORed with bits of the row so that the 8 rows one ldmatrix reads at
// one chunk fall in 8 distinct bank groups. 64-byte rows (kBK columns: transposed W tiles, x
// tiles) pair up in 128 bytes, so they XOR with (row / 2) % 4; rows of whole 128-byte groups
// (W tiles [kBK][BN]) with row % 8.
template <int COLS>
__device__ __forceinline__ int w_index(int row, int col) {
  static_assert(COLS == kBK || COLS % 64 == 0, "64-byte rows or whole 128-byte groups");
  const int swz = COLS == kBK ? (row >> 1) & 3 : row & 7;
  return row * COLS + (((col >> 3) ^ swz) << 3) + (col & 7);
}

// Fills one W tile buffer: W^T rows [j0, j0 + BN) x k [k0, k0 + kBK), zero outside W.
// Shared memory rows follow W's rows (contiguous in both): tile row r is W row g0 + r from
// column c0, where (g0, c0) = (j0, k0) when transposed, else (k0, j0).
template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void load_w_tile(const Args<T>& a, T* dst, int j0, int k0) {
  constexpr int ROWS = TRANS ? Tile::BN : kBK;
  constexpr int COLS = TRANS ? kBK : Tile::BN;
  constexpr int V = 16 / sizeof(T);
  constexpr int CHUNKS = ROWS * COLS / V;
  static_assert(CHUNKS % Tile::THREADS == 0, "whole 16-byte chunks per thread");
  const int g0 = TRANS ? j0 : k0, c0 = TRANS ? k0 : j0;
  if (a.w_vec) {
#pragma unroll
    for (int i = 0; i < CHUNKS / Tile::THREADS; ++i) {
      const int c = threadIdx.x + i * Tile::THREADS;
      const int r = c / (COLS / V), col = c % (COLS / V) * V;
      // K is a multiple of V here, so a chunk lies wholly inside or outside W.
      const bool in = g0 + r < a.k && c0 + col < a.k;
      copy16(dst + w_index<COLS>(r, col),
             in ? a.w + static_cast<int64_t>(g0 + r) * a.k + c0 + col : a.w, in);
    }
  } else {
    for (int e = threadIdx.x; e < ROWS * COLS; e += Tile::THREADS) {
      const int r = e / COLS, col = e % COLS;
      dst[w_index<COLS>(r, col)] = w_or_zero(a, g0 + r, c0 + col);
    }
  }
}

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

// Whether this compilation pass has T's mma.sync (bf16 from sm_80, fp16 from sm_75); the
// host pass says yes. The launchers never pick a kernel where it is compiled without.
template <typename T>
constexpr bool has_mma() {
#if defined(__CUDA_ARCH__)
  return std::is_same_v<T, __nv_bfloat16> ? __CUDA_ARCH__ >= 800 : __CUDA_ARCH__ >= 750;
#else
  return true;
#endif
}

template <typename T, bool TRANS, class Tile>
__global__ void __launch_bounds__(Tile::THREADS)
    mma_kernel(const __grid_constant__ Args<T> a) {
  if constexpr (has_mma<T>())
    mma_body<T, TRANS, Tile>(a);
  else
    __trap();
}

// ---------------------------------------------------------------------------------------
// Few-rows kernel (fp16/bf16, sm_80+ and fp16 on sm_75; at most kFewRowsMax rows: decoding).
//
// With so few rows, x @ W is bound by reading W once, and the staging kernels' row blocks
// would leave most of the GPU idle. Here every block owns BN = 16 * NA output columns of all
// the rows: its warps split K among them, each streaming its share of the block's W columns
// from global memory straight into mma.sync fragments (no shared memory, no cp.async), and x's
// few rows come from L2. The warps' partial sums meet in shared memory; the grid (launched
// cooperatively, every block resident) then syncs, since every block reads all of x, and
// each block writes its columns over x. So the default path's cuBLAS GEMM into a fresh
// output and its copy back become one kernel and no memory.
//
// The MMA computes out^T = Wv^T x^T as the staging kernel does: W the 16-row A operand
// (rows = output columns j), x the 8-wide B operand (columns = x's rows n, MT tiles of 8).
// A sum over k may take its terms in any order, so each thread loads chunks of W (4-16 bytes,
// see FewRowsStep) and x and feeds them to fragment slots of the k order that suits the load;
// A and B use the same order. Fragment slots (g = lane / 4, q = lane % 4): a[0] (row g, k 2q
// and 2q + 1), a[1] (row g + 8, same k), a[2] and a[3] (rows g, g + 8, k 2q + 8 and 2q + 9);
// b[0] (k 2q and 2q + 1, column g), b[1] (k 2q + 8 and 2q + 9); d[0..1] (row g, columns 2q
// and 2q + 1), d[2..3] (row g + 8).
//
// Against cuBLAS + copy_ (H100, fp16/bf16, GPU time; benchmarks/results/
// square_matmul_overlap.md, stops 40, 41 and 45): up to 16 rows and K = 4096, x @ W^T 3-27%
// faster, x @ W of one row 0-20% (stop 45), 9-16 rows 3-11% faster at K = 1024 but up to 9%
// slower at 2048; at K = 8192 0-3% slower; from 17 rows 14-75% slower (x's rows, read by
// every block, outweigh its W columns), except x @ W^T of 17-32 rows at K <= 2048 (0-15%
// faster). So where there is a workspace for cuBLAS's output it runs only where
// square_matmul_few_rows_suits says; where there is none it runs up to kFewRowsMax rows and
// any K whose blocks all fit at once, against the zero-workspace kernel's row blocks, which
// leave most of the GPU idle with so few rows (1.5-5x slower).
constexpr int kFewRowsMax = 64;
// Warps per block, chosen at launch (launch_few_rows): from 4 up to 16, or up to 8 where a
// thread's accumulators for 32 or more rows need more than the 128 registers of 16 warps.
constexpr int kFewWarpsMin = 4;
template <int MT>
constexpr int few_warps_max() {
  return MT <= 2 ? 16 : 8;
}

// W rows and x rows of one step of a warp, and the MMAs on them. TRANS (W^T: W's row j is
// Wv's column j, contiguous along k): a step covers 32 k; the thread loads 8 k from k0 + 8q
// of W rows j0 + 16i + g and + 8 (tile i), and the same 8 k of x's row 8t + g (tile t); the
// chunks' 32-bit words 2u and 2u + 1 feed slots k 2q.. and 2q + 8.. of the step's u-th MMA.
// Output row r of tile i is column j0 + 16i + r.
// Not TRANS (W's row k is contiguous along the output columns): a step covers 16 k; the
// thread loads 2 NA columns from j0 + 2 NA g of W rows k0 + 4q + s (s = 0..3), and 4 k from
// k0 + 4q of x's row 8t + g. Rows s = 0, 1 pair up (byte_perm) into slot k 2q.., rows 2, 3
// into k 2q + 8..; of the pairs of column c, c = 2i goes to row g of tile i and c = 2i + 1 to
// row g + 8: output row g + 8h of tile i is column j0 + 2 NA g + 2i + h.
template <typename T, bool TRANS, int NA, int MT>
struct FewRowsStep {
  static constexpr int KS = TRANS ? 32 : 16;                  // k per step
  static constexpr int W_LOADS = TRANS ? 2 * NA : 4;           // W chunks per thread
  static constexpr int W_WORDS = TRANS ? 4 : NA;               // 32-bit words per W chunk
  static constexpr int X_WORDS = TRANS ? 4 : 2;                // per x chunk
  // Steps in flight per thread: as many as about 80 registers hold beside the accumulators
  // (of 128 at 16 warps; 128 of 255 at 8, where more spilled).
  static constexpr int kUnroll =
      std::max(1, std::min(8, ((few_warps_max<MT>() == 16 ? 80 : 128) - 4 * NA * MT) /
                                  (W_LOADS * W_WORDS + MT * X_WORDS)));
  uint32_t w[W_LOADS][W_WORDS];
  uint32_t x[MT][X_WORDS];

  // A chunk where `in`, else dst unchanged. W through the read-only path; not x, which the
  // kernel writes (after its last read).
  template <bool READ_ONLY, int WORDS>
  __device__ __forceinline__ static void load(uint32_t (&dst)[WORDS], const T* src, bool in) {
    static_assert(WORDS == 1 || WORDS == 2 || WORDS == 4, "4-, 8- or 16-byte chunks");
    if (!in) return;
    if constexpr (WORDS == 1) {
      const auto* p = reinterpret_cast<const uint32_t*>(src);
      dst[0] = READ_ONLY ? __ldg(p) : *p;
    } else if constexpr (WORDS == 4) {
      const auto* p = reinterpret_cast<const uint4*>(src);
      const uint4 v = READ_ONLY ? __ldg(p) : *p;
      dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    } else {
      const auto* p = reinterpret_cast<const uint2*>(src);
      const uint2 v = READ_ONLY ? __ldg(p) : *p;
      dst[0] = v.x, dst[1] = v.y;
    }
  }

  // Where this thread's chunks of step 0 start (nullptr: outside W or past x's last row,
  // read as zeros), set once per block; step k0's are k0 further along x's rows and W's
  // rows (TRANS) or k0 rows of W further (not TRANS).
  struct Base {
    const T* w[W_LOADS];
    const T* x[MT];
  };

  __device__ __forceinline__ static Base base(const Args<T>& a, int j0, int g, int q) {
    Base b;
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l) {
      // TRANS: W row j from k 8q; else W row 4q + l from column j.
      const int j = TRANS ? j0 + 16 * (l / 2) + g + 8 * (l % 2) : j0 + 2 * NA * g;
      b.w[l] = j >= a.k ? nullptr
               : TRANS  ? a.w + static_cast<int64_t>(j) * a.k + 8 * q
                        : a.w + static_cast<int64_t>(4 * q + l) * a.k + j;
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const int n = 8 * t + g;
      b.x[t] = n < a.rows ? a.x + a.row.offset(n) + (TRANS ? 8 : 4) * q : nullptr;
    }
    return b;
  }

  // Every chunk zero: those outside W or x are never loaded (fetch) and stay so.
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l)
#pragma unroll
      for (int v = 0; v < W_WORDS; ++v) w[l][v] = 0;
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int v = 0; v < X_WORDS; ++v) x[t][v] = 0;
  }

  // The step at k0, a multiple of KS. K is a multiple of KS, so a step lies wholly inside K,
  // or past it where `live` is false: nothing is loaded then (nor multiplied).
  __device__ __forceinline__ void fetch(const Args<T>& a, const Base& b, int k0, bool live) {
    const int64_t w_off = TRANS ? k0 : static_cast<int64_t>(k0) * a.k;
#pragma unroll
    for (int l = 0; l < W_LOADS; ++l) load<true>(w[l], b.w[l] + w_off, live && b.w[l]);
#pragma unroll
    for (int t = 0; t < MT; ++t) load<false>(x[t], b.x[t] + k0, live && b.x[t]);
  }

  __device__ __forceinline__ void mma(float (&acc)[NA][MT][4]) const {
    if constexpr (TRANS) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < NA; ++i) {
          const uint32_t af[4] = {w[2 * i][2 * u], w[2 * i + 1][2 * u], w[2 * i][2 * u + 1],
                                  w[2 * i + 1][2 * u + 1]};
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint32_t bf[2] = {x[t][2 * u], x[t][2 * u + 1]};
            mma_16816<T>(acc[i][t], af, bf);
          }
        }
    } else {
#pragma unroll
      for (int i = 0; i < NA; ++i) {
        // Columns 2i (row g) and 2i + 1 (row g + 8) are the halves of word i: 0x5410 pairs
        // the low halves of two words, 0x7632 the high ones (the first word's in the low
        // half, the smaller k).
        const uint32_t af[4] = {__byte_perm(w[0][i], w[1][i], 0x5410),
                                __byte_perm(w[0][i], w[1][i], 0x7632),
                                __byte_perm(w[2][i], w[3][i], 0x5410),
                                __byte_perm(w[2][i], w[3][i], 0x7632)};
#pragma unroll
        for (int t = 0; t < MT; ++t) mma_16816<T>(acc[i][t], af, x[t]);
      }
    }
  }

  // The output column of accumulator row r (0..15) of tile i.
  __device__ __forceinline__ static int column(int j0, int i, int r) {
    return TRANS ? j0 + 16 * i + r : j0 + 2 * NA * (r % 8) + 2 * i + r / 8;
  }
};

template <typename T, bool TRANS, int NA, int MT>
__device__ __forceinline__ void few_rows_body(const Args<T>& a) {
  using Step = FewRowsStep<T, TRANS, NA, MT>;
  constexpr int BN = 16 * NA, U = Step::kUnroll, ACC = NA * MT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int j0 = blockIdx.x * BN;

  const typename Step::Base base = Step::base(a, j0, g, q);
  float acc[NA][MT][4] = {};
  const int steps = a.k / Step::KS;
  // Warp w takes steps w, w + warps, ...: the warps of a block read neighbouring k. U steps
  // in flight: each step's registers are fetched again, U steps on, once its MMAs have
  // issued.
  Step st[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int s = warp + u * warps;
    st[u].zero();
    st[u].fetch(a, base, s * Step::KS, s < steps);
  }
  for (int s0 = warp; s0 < steps; s0 += U * warps) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u * warps < steps) st[u].mma(acc);
      const int s = s0 + (U + u) * warps;
      st[u].fetch(a, base, s * Step::KS, s < steps);
    }
  }

  // Partial sums of the warps, [warp][accumulator][lane]; thread e sums element e of every
  // warp into warp 0's (the only thread to read or write it).
  extern __shared__ __align__(16) unsigned char smem[];
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < NA; ++i)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        part[(warp * ACC + (i * MT + t) * 4 + c) * 32 + lane] = acc[i][t][c];
  __syncthreads();
  for (int e = threadIdx.x; e < ACC * 32; e += blockDim.x) {
    float sum = part[e];
    for (int w = 1; w < warps; ++w) sum += part[w * ACC * 32 + e];
    part[e] = sum;
  }

  // Every block has read all of x's rows once every block is here.
  cg::this_grid().sync();
  for (int e = threadIdx.x; e < ACC * 32; e += blockDim.x) {
    // e = (accumulator index, lane of the thread that held it); accumulator (i, t, c):
    // row g' + 8 (c / 2) of tile i, x row 8t + 2q' + c % 2, (g', q') of that lane.
    const int l = e % 32, idx = e / 32;
    const int c = idx % 4, t = idx / 4 % MT, i = idx / 4 / MT;
    const int j = Step::column(j0, i, l / 4 + 8 * (c / 2));
    const int n = 8 * t + 2 * (l % 4) + c % 2;
    if (j < a.k && n < a.rows) {
      const float v = a.bias ? part[e] + to_float(a.bias[j]) : part[e];
      a.x[a.row.offset(n) + j] = from_float<T>(v);
    }
  }
}

template <typename T, bool TRANS, int NA, int MT>
__global__ void __launch_bounds__(few_warps_max<MT>() * 32)
    few_rows_kernel(const __grid_constant__ Args<T> a) {
  if constexpr (has_mma<T>())
    few_rows_body<T, TRANS, NA, MT>(a);
  else
    __trap();
}

// Shared memory of few_rows_kernel: the warps' partial sums.
template <int NA, int MT>
constexpr size_t few_rows_smem(int warps) {
  return static_cast<size_t>(warps) * NA * MT * 4 * 32 * sizeof(float);
}

// ---------------------------------------------------------------------------------------
// Streaming kernel (fp16/bf16, sm_90): stages the block's outputs instead of its inputs.
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
  static constexpr int kStages = mti::kStages;
  static constexpr int kMaxCluster = 8;  // the largest cluster every sm_90 part schedules
  static constexpr bool kTma = false;  // cp.async loads: every block loads all of each x tile
  static constexpr int kSmemSlack = 0;   // bytes of dynamic shared memory spent on alignment
  static_assert(X_TILE / 8 % THREADS == 0, "whole 16-byte chunks of x per thread");
  static_assert(kStages * STAGE >= BM * LAST_LD, "the last tile parks in the stages");
  static_assert(kBK % 32 == 0, "fragment buffers alternate by k16 step parity");
};

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

// The streaming kernels' last step: the block's column tiles [ct_begin, ct_end) of its nrows
// rows, parked at outs (pitch out_ld; all but the last) and in the stages (the last, pitch
// Tile::LAST_LD), go over x, 16 bytes at a time, after a barrier that orders the reads of x
// (the whole cluster's) before the writes and makes the parked tiles visible block-wide.
template <typename T, class Tile>
__device__ __forceinline__ void write_parked(const Args<T>& a, const int64_t* row_off,
                                             int nrows, const T* outs, int out_ld,
                                             const T* stages, int ct_begin, int ct_end,
                                             int parked) {
  constexpr int BN = Tile::BN;
  if (a.cluster > 1)
    cluster_sync();
  else
    __syncthreads();
  const int col0 = ct_begin * BN;
  const int last0 = parked * BN;  // the last tile's first column, from col0
  const int chunks = (min(ct_end * BN, a.k) - col0) / 8;  // per row; K is a multiple of 8
  for (int c = threadIdx.x; c < nrows * chunks; c += Tile::THREADS) {
    const int r = c / chunks, col = (c - r * chunks) * 8;
    const T* src = col < last0 ? outs + r * out_ld + col
                               : stages + r * Tile::LAST_LD + (col - last0);
    *reinterpret_cast<uint4*>(a.x + row_off[r] + col0 + col) =
        *reinterpret_cast<const uint4*>(src);
  }
}

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
    a_off[s] = sizeof(T) * w_index<kBK>(warp_r * MT * 16 + (mi & 1) * 8 + mr,
                                        s * 16 + (mi >> 1) * 8);
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
  auto load_frags = [&](uint32_t st, int s, uint32_t(&af)[MT][4], uint32_t(&bf)[NT][2]) {
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
        for (int nt = 0; nt < NT; ++nt)
          mma_16816<T>(acc[mt][nt], af[s % 2][mt], bf[s % 2][nt]);
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

// ---------------------------------------------------------------------------------------
// Warpgroup streaming kernel (fp16/bf16, sm_90a builds on sm_90): the streaming kernel's
// scheme (a cluster shares a row block of BM rows; each block computes its column tiles, parks
// them on chip and writes them over x after a cluster barrier) on Hopper's warpgroup MMA
// (kernels/wgmma.cuh), fed by the TMA. A k step of 64 (one 128-byte swizzled row of x and W
// per row) is four m64n256k16 MMAs for each of two consumer warpgroups, each accumulating a
// 64 x 256 fp32 tile; a producer warp issues the loads kStages steps ahead, and mbarriers say
// when a stage is full (its bytes landed) and when it is empty (every block that wrote into it
// has had its MMAs finish reading it). Every block of a cluster needs the same x tiles, so each
// loads BM / cluster rows of a tile and multicasts them to all: L2 serves x once per cluster,
// not once per block. Each step has a fixed cost (barrier waits and arrivals across the
// cluster), so steps are as long as the 128-byte swizzle allows: H100, bf16, against
// torch.matmul, steps of 64 k in 3-4 stages ran at 0.64-0.75x its speed where steps of 32 k
// in 6-8 stages (more loads in flight) ran at 0.38-0.46x. (Also multicasting W between two
// row blocks of a cluster, which halves what L2 serves, measured no faster.) So that every
// block waits for the same x tiles, all blocks of a cluster walk tpc column tiles; a block
// with fewer (the last, when the tiles do not split evenly) consumes the x tiles of the
// missing ones without MMAs. (A persistent form, a cluster per row block at a time walking
// row blocks so that the producer loads the next one's tiles while the consumers write the
// last tile straight from the accumulators, measured slower at K = 1024-2048: 0.60-0.68x
// torch.matmul against 0.67-0.75x at M >= 16384; faster at K = 8192, 0.68-0.90x against
// 0.60-0.79x at M = 65536.)
// Column tiles of BN = 256, so K = 4096 takes a cluster of 8 blocks of two tiles (or 16 of
// one); K = 8192 one of 16 blocks of two (the H100 schedules 16, not every sm_90 part: there
// no plan fits and the mma.sync kernels run). x's rows must be evenly spaced (one tensor map).
template <int STAGES>
struct WgmmaTile {
  static constexpr int BM = 128;
  static constexpr int BN = 256;
  static constexpr int BK = kSwizzleBytes / 2;  // one swizzle row of 16-bit elements
  static constexpr int kConsumers = 2;  // warpgroups of MMAs, 64 rows each
  static constexpr int THREADS = 128 * (kConsumers + 1);
  static constexpr int kStages = STAGES;
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int STAGE = BM * BK + BK * BN;  // elements
  static constexpr int kOutPad = 8;                // as StreamTile's
  static constexpr int LAST_LD = BN + kOutPad;
  static constexpr int kBlocksPerSm = 1;
  static constexpr int kMaxCluster = 16;
  // Fed by the TMA (tensor maps), each x tile split among the cluster's blocks, which
  // multicast their pieces, in whole 8-row swizzle atoms (1024 bytes, which keeps every piece
  // aligned as the swizzle needs).
  static constexpr bool kTma = true;
  // CTAs that share each W tile, each loading 1 / kWParts of it for all (the handshake
  // kernel's clusters); 1: each loads its own.
  static constexpr int kWParts = 1;
  // The stages start 1024-byte aligned (swizzle); a full and an empty barrier per stage.
  static constexpr int kSmemSlack = 1024 + 2 * kStages * 8;
  // The producer warpgroup needs few registers; the two MMA warpgroups take what it gives up
  // (2 x 128 x 232 + 128 x 40 <= 65536).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kStages * STAGE >= BM * LAST_LD, "the last tile parks in the stages");
  static_assert(A_BYTES % 1024 == 0 && STAGE * 2 % 1024 == 0, "tiles stay 1024-byte aligned");
};

// The tensor maps of a launch: x's rows (box BK columns x BM / cluster rows) and W (box
// BK x BN of W's rows j when transposed, else BK-row by BK-column boxes), 128-byte swizzled.
struct TmaMaps {
  CUtensorMap x;
  CUtensorMap w;
};

// The stages' barriers, at full0 and empty0 (8 bytes apart each): a stage is full when the
// producer has arrived and the TMA's bytes have landed, empty when `consumers` arrivals
// (one per consumer warpgroup of every block that reads it) have come. One thread calls it.
template <int S>
__device__ __forceinline__ void init_stage_barriers(uint32_t full0, uint32_t empty0,
                                                    uint32_t consumers) {
  for (int s = 0; s < S; ++s) {
    mbar_init(full0 + 8 * s, 1);
    mbar_init(empty0 + 8 * s, consumers);
  }
  mbar_init_fence();
}

// Loads part `part` of Tile::kWParts of the (BK x BN) W tile of k [k0, k0 + BK) and output
// columns [j0, j0 + BN) into the W part of the stage at shared address st, counted on barrier
// `full`, and with kWParts > 1 multicast to the cluster's kWParts CTAs (the same address and
// barrier in each): BN / kWParts of W's rows j when transposed (the map's box), else
// BN / BK / kWParts boxes of BK rows k by BK columns j.
template <bool TRANS, class Tile>
__device__ __forceinline__ void tma_load_w(uint32_t st, const TmaMaps& maps, int k0, int j0,
                                           uint32_t full, int part = 0) {
  constexpr int BN = Tile::BN, BK = Tile::BK, P = Tile::kWParts;
  const uint32_t wt = st + Tile::A_BYTES;
  auto load = [&](uint32_t dst, int c0, int c1) {
    if constexpr (P > 1)
      tma_load_2d_multicast(dst, &maps.w, c0, c1, full, static_cast<uint16_t>((1u << P) - 1));
    else
      tma_load_2d(dst, &maps.w, c0, c1, full);
  };
  if constexpr (TRANS) {
    constexpr int kRows = BN / P;
    load(wt + part * kRows * kSwizzleBytes, k0, j0 + part * kRows);
  } else {
    constexpr int kBoxes = BN / BK / P;
#pragma unroll
    for (int b = part * kBoxes; b < (part + 1) * kBoxes; ++b)
      load(wt + b * BK * kSwizzleBytes, j0 + BK * b, k0);
  }
}

// Consumer warpgroup c's MMAs on the stage at shared address st (rows [64 c, 64 c + 64) of
// its x tile by its W tile), added to acc unless this is a tile's first stage (accumulate
// false), committed as one group.
template <typename T, bool TRANS, class Tile>
__device__ __forceinline__ void mma_stage(float (&acc)[128], uint32_t st, int c,
                                          bool accumulate) {
  constexpr int BK = Tile::BK, RB = kSwizzleBytes, ATOM = 8 * kSwizzleBytes;
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < BK / 16; ++s) {
    // k16 step s: 32 bytes into x's (and transposed W's) rows, 16 rows into W's.
    const uint64_t da = smem_desc(st + c * 64 * RB + s * 32, 16, ATOM);
    const uint64_t db = TRANS ? smem_desc(st + Tile::A_BYTES + s * 32, 16, ATOM)
                              : smem_desc(st + Tile::A_BYTES + s * 16 * RB, BK * RB, ATOM);
    wgmma_m64n256k16<T, !TRANS>(acc, da, db, accumulate || s > 0);
  }
  wgmma_commit();
}

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
    // Parks the finished tile of output columns [j0, j0 + BN) at dst (pitch ld). (Through
    // bias_pair, with its plain loads and a test of K per column pair, the kernel measured
    // 5-12% slower at K = 1024-2048 on an H100; the __ldg here stay under the test in the
    // PTX, so they are not the hazard bias_pair avoids.)
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
    wgmma_stream_kernel(const __grid_constant__ Args<T> a,
                        const __grid_constant__ TmaMaps maps) {
#if MTI_WGMMA
  wgmma_body<T, TRANS, Tile>(a, maps);
#else
  __trap();  // the launcher runs it only where has_wgmma() says this build has it
#endif
}

// ---------------------------------------------------------------------------------------
// Handshake kernel (fp16/bf16, sm_90a builds on sm_90; the default path's, as it needs a few
// bytes of counters): an ordinary GEMM whose epilogue writes over x, made safe by a
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
// asynchronously. (Staged before the next tile's MMAs instead, the epilogue held both MMA
// warpgroups up: H100, bf16, M = 16384-65536, 2-5% slower at K = 1024-2048, alike at 4096 and
// 8192. Written from the registers straight to x, every CTA's stores came at once, at the end
// of each round, and the MMAs waited for them: 0.58-0.65x torch.matmul at K = 1024.)
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
  const int64_t tiles = (row_blocks + C - 1) / C * col_tiles;  // of groups
  const int j0 = static_cast<int>(cluster_id % col_tiles) * BN;  // the same in every round
  const int tid = static_cast<int>(threadIdx.x);
  // This CTA's row block in group tile i (with C > 1, past the last one for the last CTA of a
  // last group that has fewer: it loads and shares its part of W all the same).
  auto row_block = [&](int64_t i) { return i / col_tiles * C + rank; };
  // The CTA's steps (k tiles of its tiles, in order: the stages are a ring across tiles): at
  // most (row_blocks + 1) * k_tiles (G >= T), about M * K / 8192, an int for any x of fewer
  // than 2^44 elements.
  const int steps = cluster_id < tiles
                        ? static_cast<int>((tiles - 1 - cluster_id) / clusters + 1) * k_tiles
                        : 0;
  // The producer's next step t: k tile kt of the CTA's tile i, of row block rb. Advanced in
  // place: computed from t by 64-bit divisions, the step's indices held the loads up (H100,
  // bf16: 8-18% slower at every K and M).
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
  // kernel ends. Tested only when the tile's MMAs are done: tested at once, the add's round
  // trip held the leader's warpgroup up (H100, bf16, in turns with torch.matmul: M = 4096,
  // K = 4096 0.970 -> 0.976 of its speed; K = 1024 0.915 -> 0.928; M = 65536, K = 4096
  // 0.978 -> 0.984).
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

bool has_wgmma() {
  static std::atomic<int> cache[kMaxDevices];
  return once_per_device(cache, [](int) {
           cudaFuncAttributes attr{};
           return cudaFuncGetAttributes(&attr, wgmma_probe_kernel) == cudaSuccess &&
                  attr.sharedSizeBytes > 0;
         }) == 1;
}

// ---------------------------------------------------------------------------------------
// FMA kernel (float; fp16/bf16 without tensor cores). 8 warps; warp w owns rows w + 8 i
// (i < RM) and lane l the columns l + 32 q (q < 4) of a BN = 128 column tile. W tiles are
// double-buffered in shared memory, the next one prefetched into registers meanwhile.

template <int BM_>
struct FmaTile {
  static constexpr int BM = BM_;
  static constexpr int THREADS = 256;
  static constexpr int BN = 128;
  static constexpr int RM = BM / 8;
  // Staged rows are read by broadcast (a warp reads one row), so need no pad.
  static constexpr int kXPad = kFmaXPad;
  static constexpr int kWBuffers = 2;
  // As MmaTile::kWCost: ~32 bytes per clock from L2 against ~256 flops per clock of FFMA,
  // with 4-byte W elements.
  static constexpr int kWCost = 16;
  // W tile: [BN][kBK + 1] when transposed (lanes read 32 rows j at one k: the odd pitch
  // spreads them over all banks), else [kBK][BN] (lanes read consecutive j).
  __host__ __device__ static constexpr int w_ld(bool trans) { return trans ? kBK + 1 : BN; }
  __host__ __device__ static constexpr int w_tile_elems(bool trans) {
    return (trans ? BN : kBK) * w_ld(trans);
  }
  static_assert(RM >= 1 && BM % 8 == 0, "8 warps own the rows");
};

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
__global__ void __launch_bounds__(Tile::THREADS)
    fma_kernel(const __grid_constant__ Args<T> a) {
  fma_body<T, TRANS, Tile>(a);
}

// ---------------------------------------------------------------------------------------
// Host side: pick the kernel family and tile, split the work, launch.

template <class... Tiles>
struct TileList {};
// Largest rows per block first. The more rows a block owns, the more output each W tile read
// from L2 feeds, and the rows of all K columns must fit in shared memory: on an H100 (227 KB)
// that is 96 rows at K = 1024, 48 at 2048, 24 at 4096, 8 at 8192 for 16-bit types.
using MmaTiles = TileList<MmaTile<128, 2>, MmaTile<96, 2>, MmaTile<64, 2>, MmaTile<48, 1>,
                          MmaTile<32, 1>, MmaTile<24, 1>, MmaTile<16, 1>, MmaTile<8, 1>>;
using FmaTiles = TileList<FmaTile<64>, FmaTile<32>, FmaTile<16>, FmaTile<8>>;

template <typename T, bool TRANS, int BM, int WR>
auto kernel_of(MmaTile<BM, WR>) {
  return &mma_kernel<T, TRANS, MmaTile<BM, WR>>;
}
template <typename T, bool TRANS, int BM>
auto kernel_of(FmaTile<BM>) {
  return &fma_kernel<T, TRANS, FmaTile<BM>>;
}

template <typename T>
bool use_tensor_cores(const DeviceInfo& d) {
  return sizeof(T) == 2 && (d.cc >= 80 || (d.cc >= 75 && std::is_same_v<T, __half>));
}

template <class Tile>
size_t smem_bytes(int kpad, bool trans, size_t elem) {
  return Tile::BM * sizeof(int64_t) +
         static_cast<size_t>(Tile::BM) * (kpad + Tile::kXPad) * elem +
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
bool may_slice(int64_t row_blocks, int col_tiles, const DeviceInfo& d) {
  return row_blocks < d.sm_count && col_tiles > 1 && d.coop;
}

// As many slices as `resident` blocks allow (the grid sync needs every block resident).
Split split_work(int64_t rows, int bm, int col_tiles, int64_t resident, const DeviceInfo& d) {
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
// a column tile costs streaming its W tiles (Tile::kWCost, in rows' worth of arithmetic) plus
// BM rows of arithmetic.
template <class Tile>
int64_t launch_cost(int64_t rows, int k, int kpad, bool trans, size_t elem,
                    const DeviceInfo& d) {
  const size_t smem = smem_bytes<Tile>(kpad, trans, elem);
  if (smem > static_cast<size_t>(d.smem_optin)) return INT64_MAX;
  const int col_tiles = (k + Tile::BN - 1) / Tile::BN;
  const int64_t per_sm = std::max<int64_t>(
      1, std::min<int64_t>(d.smem_per_sm / (smem + d.smem_reserved),
                           d.threads_per_sm / Tile::THREADS));
  const Split s = split_work(rows, Tile::BM, col_tiles, per_sm * d.sm_count, d);
  const int64_t waves = (s.row_blocks * s.slices + d.sm_count - 1) / d.sm_count;
  return waves * s.per_block * (Tile::kWCost + Tile::BM);
}

// Index of the tile to use: the cheapest by launch_cost, the one with more rows on a tie
// (less W traffic in total); -1 when none fits.
template <class... Tiles>
int pick_tile(TileList<Tiles...>, int64_t rows, int k, int kpad, bool trans, size_t elem,
              const DeviceInfo& d) {
  const int64_t cost[] = {launch_cost<Tiles>(rows, k, kpad, trans, elem, d)...};
  int best = -1;
  for (int i = 0; i < static_cast<int>(sizeof...(Tiles)); ++i)
    if (cost[i] < INT64_MAX && (best < 0 || cost[i] < cost[best])) best = i;
  return best;
}

template <typename T, bool TRANS, class Tile>
cudaError_t launch_tile(Args<T> a, const DeviceInfo& d, cudaStream_t stream) {
  const auto kernel = kernel_of<T, TRANS>(Tile{});
  const size_t smem = smem_bytes<Tile>(a.kpad, TRANS, sizeof(T));
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
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

template <typename T, bool TRANS, class... Tiles>
cudaError_t launch_family(TileList<Tiles...> tiles, const Args<T>& a, const DeviceInfo& d,
                          cudaStream_t stream) {
  const int index = pick_tile(tiles, a.rows, a.k, a.kpad, TRANS, sizeof(T), d);
  if (index < 0) return cudaErrorInvalidValue;
  cudaError_t err = cudaErrorInvalidValue;
  int i = 0;
  // Runs launch_tile for the index-th tile type.
  ((i++ == index ? (err = launch_tile<T, TRANS, Tiles>(a, d, stream), 0) : 0), ...);
  return err;
}


// Streaming kernels: the blocks of a cluster share a row block, so a cluster must fit on the
// GPU at once (Tile::kMaxCluster).
using StreamTiles = TileList<StreamTile<4>, StreamTile<2>>;
// Four stages where they fit beside the parked tiles (one column tile per block), else three
// (two).
using WgmmaTiles = TileList<WgmmaTile<4>, WgmmaTile<3>>;

template <typename T, bool TRANS, int MT>
auto stream_kernel_of(StreamTile<MT>) {
  return &stream_kernel<T, TRANS, StreamTile<MT>>;
}
template <typename T, bool TRANS, int STAGES>
auto stream_kernel_of(WgmmaTile<STAGES>) {
  return &wgmma_stream_kernel<T, TRANS, WgmmaTile<STAGES>>;
}

template <class Tile>
size_t stream_smem_bytes(int tpc, size_t elem) {
  return Tile::kSmemSlack + Tile::BM * sizeof(int64_t) +
         (static_cast<size_t>(Tile::kStages) * Tile::STAGE +
          static_cast<size_t>(Tile::BM) * ((tpc - 1) * Tile::BN + Tile::kOutPad)) *
             elem;
}

// Column tiles per block and blocks per cluster; cost in the units of launch_cost.
struct StreamPlan {
  int tpc = 0;
  int cluster = 0;
  int64_t cost = INT64_MAX;  // INT64_MAX: no such launch fits
};

// The streaming kernel of Tile with its shared memory limit raised to smem and, for clusters
// past the portable 8, non-portable sizes allowed; and its launch configuration for row_blocks
// row blocks in clusters of `cluster` (the grid at most INT_MAX blocks; see launch_stream_tile).
template <typename T, bool TRANS, class Tile>
cudaError_t stream_config(size_t smem, int cluster, int64_t row_blocks, cudaStream_t stream,
                          cudaLaunchAttribute* attr, cudaLaunchConfig_t* cfg) {
  const auto kernel = stream_kernel_of<T, TRANS>(Tile{});
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
  cfg->gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(row_blocks, INT_MAX / cluster) *
                                            cluster));
  return err;
}

// Clusters of `cluster` blocks of Tile that the current device runs at once (0: none fits).
// Not simply the multiprocessors divided by the cluster size: a cluster's blocks share a GPC,
// so on an H100 (132 SMs, one block per SM) 30 clusters of 4 fit, 15 of 8 and 7 of 16. Asked
// once per device and cluster size; blocks per SM are bound by registers, not by the shared
// memory of the plan at hand (Tile::kBlocksPerSm = 1).
template <typename T, bool TRANS, class Tile>
int64_t resident_clusters(int cluster, size_t smem) {
  static_assert(Tile::kBlocksPerSm == 1, "occupancy cached per cluster size only");
  static std::atomic<int> cache[Tile::kMaxCluster + 1][kMaxDevices];
  return once_per_device(cache[cluster], [&](int) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg;
    int clusters = 0;
    // A cluster size the device refuses: none resident, not an error of the op.
    return stream_config<T, TRANS, Tile>(smem, cluster, 1, nullptr, &attr, &cfg) == cudaSuccess &&
                   cudaOccupancyMaxActiveClusters(&clusters, stream_kernel_of<T, TRANS>(Tile{}),
                                                  &cfg) == cudaSuccess
               ? clusters
               : 0;
  });
}

// The cheapest split of the column tiles among the blocks of a cluster: waves of the clusters
// that are resident at once (resident_clusters), the blocks that share a multiprocessor in a
// wave sharing its throughput, each block doing tpc column tiles, and a column tile costing
// its BM rows of MMAs plus streaming its BM + BN rows of x and W from L2 (at an eighth of a
// row of MMAs each: launch_cost's MmaTile::kWCost puts a row's load at a quarter of a
// 128-column row of MMAs, and these rows are BN = 256 columns wide). Smaller clusters win
// ties. (H100, bf16, M = 16384: a cluster of 2 blocks of 2 tiles each at K = 1024 ran 25%
// faster than one of 4 blocks of 1 tile, which takes 5 waves of 30 clusters for 128 row
// blocks instead of 2 of 66.) Where the blocks multicast x (Tile::kTma), each loads
// BM / cluster rows of it. Launches whose blocks would not fill half of the
// multiprocessors are left to the staging kernel, which slices the columns finer.
template <typename T, bool TRANS, class Tile>
StreamPlan plan_stream(int64_t rows, int k, const DeviceInfo& d) {
  StreamPlan best;
  const int col_tiles = (k + Tile::BN - 1) / Tile::BN;
  const int64_t row_blocks = (rows + Tile::BM - 1) / Tile::BM;
  for (int cluster = 1; cluster <= std::min(Tile::kMaxCluster, col_tiles); ++cluster) {
    const int tpc = (col_tiles + cluster - 1) / cluster;
    if ((col_tiles + tpc - 1) / tpc != cluster) continue;  // a block would be left empty
    if (Tile::kTma && Tile::BM / 8 % cluster != 0) continue;  // whole 8-row pieces
    if (2 * row_blocks * cluster < d.sm_count) continue;
    const size_t smem = stream_smem_bytes<Tile>(tpc, sizeof(T));
    if (smem > static_cast<size_t>(d.smem_optin)) continue;
    const int64_t resident = resident_clusters<T, TRANS, Tile>(cluster, smem);
    if (resident == 0) continue;
    const int64_t per_sm = std::max<int64_t>(1, ceil_div(resident * cluster, d.sm_count));
    const int64_t waves = ceil_div(row_blocks, resident);
    const int x_rows = Tile::kTma ? Tile::BM / cluster : Tile::BM;  // loaded per block
    const int64_t cost = waves * per_sm * tpc * (Tile::BM + (x_rows + Tile::BN) / 8);
    if (cost < best.cost) best = {tpc, cluster, cost};
  }
  return best;
}

// The driver's cuTensorMapEncodeTiled (through the runtime, so nothing links libcuda), or
// nullptr where the driver lacks it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 16-bit matrix of `rows` rows of `cols` elements, rows `pitch` bytes apart, seen in boxes
// of box_cols x box_rows, swizzled as kSwizzleBytes says; reads past its edges give zeros.
static_assert(kSwizzleBytes == 128, "encode_map's CU_TENSOR_MAP_SWIZZLE_128B");
template <typename T>
bool encode_map(CUtensorMap* map, const T* base, int64_t cols, int64_t rows, int64_t pitch,
                int box_cols, int box_rows) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return encode_tiled()(map,
                        std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                  : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                        2, const_cast<T*>(base), dims, strides, box, unit,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether the warpgroup kernel can describe x by one tensor map: evenly spaced rows (what
// the layout merged to one leading dim, or a single row) and a driver that encodes maps.
template <typename T>
bool tma_ready(const Args<T>& a) {
  return a.row.ndim <= 1 && encode_tiled() != nullptr;
}

// The tensor maps of a launch of the warpgroup kernel: x from row row0, `rows` rows.
template <typename T, bool TRANS, class Tile>
cudaError_t make_maps(const Args<T>& a, int64_t row0, int64_t rows, int cluster, TmaMaps* m) {
  const int64_t pitch = (a.row.ndim == 1 ? a.row.strides[0] : a.k) * sizeof(T);
  const bool ok =
      encode_map(&m->x, a.x + a.row.offset(row0), a.k, rows, round_up(pitch, 16), Tile::BK,
                 Tile::BM / cluster) &&
      encode_map(&m->w, a.w, a.k, a.k, a.k * sizeof(T), Tile::BK,
                 TRANS ? Tile::BN / Tile::kWParts : Tile::BK);
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

// Launches the streaming kernel with plan p (which fits: plan_stream checked).
template <typename T, bool TRANS, class Tile>
cudaError_t launch_stream_tile(Args<T> a, const StreamPlan& p, cudaStream_t stream) {
  a.col_tiles_per_block = p.tpc;
  a.cluster = p.cluster;
  // Blocks blockIdx.x = cluster * b + rank: row block first_block + b, column slice rank.
  // The warpgroup kernel's tensor-map coordinates (row b * BM + ...) are 32-bit.
  const int64_t row_blocks = (a.rows + Tile::BM - 1) / Tile::BM;
  const int64_t per_launch =  // row blocks
      Tile::kTma ? std::min(INT_MAX / p.cluster, INT_MAX / Tile::BM - 1) : INT_MAX / p.cluster;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg;
  cudaError_t err = stream_config<T, TRANS, Tile>(stream_smem_bytes<Tile>(p.tpc, sizeof(T)),
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
      if (err == cudaSuccess)
        err = cudaLaunchKernelEx(&cfg, stream_kernel_of<T, TRANS>(Tile{}), a, maps);
    } else {
      err = cudaLaunchKernelEx(&cfg, stream_kernel_of<T, TRANS>(Tile{}), a);
    }
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

// Index of the cheapest tile of Tiles for the streaming kernel and its plan (cost INT64_MAX:
// none fits). The first (more rows per block) wins a tie.
template <typename T, bool TRANS, class... Tiles>
std::pair<int, StreamPlan> best_stream_plan(TileList<Tiles...>, const Args<T>& a,
                                            const DeviceInfo& d) {
  const StreamPlan plans[] = {plan_stream<T, TRANS, Tiles>(a.rows, a.k, d)...};
  int best = 0;
  for (int i = 1; i < static_cast<int>(sizeof...(Tiles)); ++i)
    if (plans[i].cost < plans[best].cost) best = i;
  return {best, plans[best]};
}

// The streaming kernel with the cheapest tile and split. *launched stays false, and nothing
// runs, when no plan fits (the caller then uses the staging kernel). Needs sm_90 (clusters)
// and 16-byte chunks of x and W.
template <typename T, bool TRANS, class... Tiles>
cudaError_t launch_stream(TileList<Tiles...> tiles, const Args<T>& a, const DeviceInfo& d,
                          cudaStream_t stream, bool* launched) {
  *launched = false;
  const auto [best, plan] = best_stream_plan<T, TRANS>(tiles, a, d);
  if (plan.cost == INT64_MAX) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  int i = 0;
  ((i++ == best ? (err = launch_stream_tile<T, TRANS, Tiles>(a, plan, stream), 0) : 0), ...);
  *launched = true;
  return err;
}

// Whether the warpgroup streaming kernel applies to a (the zero-workspace path's first
// choice, where it finds a plan): fp16/bf16 on sm_90 with this build's sm_90a code, x's rows
// evenly spaced, 16-byte chunks of x and W.
template <typename T>
bool wgmma_applies(const Args<T>& a, const DeviceInfo& d) {
  return sizeof(T) == 2 && use_tensor_cores<T>(d) && d.cc == 90 && a.x_vec && a.w_vec &&
         has_wgmma() && tma_ready(a);
}


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

// The handshake kernel's tiles, in clusters of CLUSTER CTAs: the warpgroup kernel's with four
// stages and beside them a staging tile of kOutBoxes boxes of BK output columns, which stages
// an output tile in kOutParts parts.
template <int CLUSTER>
struct HandshakeTile : WgmmaTile<4> {
  static constexpr int kWParts = CLUSTER;  // CTAs per cluster, which share W tiles
  static constexpr int kOutBoxes = 2;
  static constexpr int kOutParts = BN / BK / kOutBoxes;
  static_assert(kOutParts * kOutBoxes * BK == BN, "whole parts");
  static constexpr size_t kSmem =
      kSmemSlack + (kStages * STAGE + BM * BK * kOutBoxes) * 2 + BN * sizeof(float);
};
// Four stages, the output tile staged in halves (the second half waits for the first half's
// stores to have read the staging tile), which leaves room for the fourth stage. H100, bf16,
// K = 1024-8192, M = 4096-65536: faster in every cell than three stages with the whole tile
// staged, by 1.5-11%.
// From K = 4096 in clusters of two CTAs that share each W tile: at large K the kernel is
// bound by L2, which every CTA's W loads crossed. H100, bf16, M = 4096-65536, two runs each
// in one build: K = 4096 up to 2% faster than the same tile in clusters of one; K = 8192
// 5-10% faster than three stages with the whole tile staged in clusters of one (M = 65536:
// 12.6-12.7 ms against 14.0-14.1), which had been kept there because four stages in clusters
// of one ran some calls at 17-25 ms instead of 12-13 (per-call CUDA events, same clocks and
// power); in clusters of two no call did. Below K = 4096 the clusters' barriers cost more
// than the shared loads save: K = 1024 and 2048, M = 4096, 4-10% slower.
using HandshakeTileDeep = HandshakeTile<1>;
using HandshakeTilePair = HandshakeTile<2>;
static_assert(HandshakeTilePair::kSmem <= 227 * 1024, "fits an H100's shared memory per block");
constexpr int kHandshakePairMinK = 4096;

// Calls f with the tile for K (a value of its type).
template <class F>
auto with_handshake_tile(int k, F&& f) {
  return k >= kHandshakePairMinK ? f(HandshakeTilePair{}) : f(HandshakeTileDeep{});
}

// A cooperative launch of `grid` CTAs of Tile's handshake kernel, in its clusters (the
// cluster attribute only where they have more than one CTA).
template <class Tile>
cudaLaunchConfig_t handshake_config(unsigned grid, cudaStream_t stream,
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

template <typename T, bool TRANS, class Tile>
auto handshake_kernel_of() {
  return &handshake_kernel<T, TRANS, Tile>;
}

// A row block's output tiles (T in the kernel's comment); BN is the same in every cluster
// size.
inline int handshake_col_tiles(int k) { return ceil_div(k, HandshakeTileDeep::BN); }
// Row blocks of `rows` rows, one counter each; BM is the same in every cluster size.
inline int64_t handshake_row_blocks(int64_t rows) {
  return ceil_div(rows, int64_t{HandshakeTileDeep::BM});
}

// The handshake kernel's grid (in CTAs) on the current device for K: as many clusters of
// Tile::kWParts CTAs as are resident at once, rounded down to a multiple of the column tiles
// (0: fewer fit than a row block has tiles). Occupancy asked once per device, after raising
// the kernel's shared memory limit there (which launch_handshake relies on).
template <typename T, bool TRANS, class Tile>
int handshake_grid(int k) {
  constexpr int C = Tile::kWParts;
  static std::atomic<int> cache[kMaxDevices];  // resident clusters
  const int resident = once_per_device(cache, [](int) {
    DeviceInfo d;
    return current_device(&d) == cudaSuccess
               ? occupancy_units(handshake_kernel_of<T, TRANS, Tile>(), Tile::THREADS, C,
                                 Tile::kSmem, d.sm_count, 0, /*cooperative=*/true)
               : 0;
  });
  const int col_tiles = handshake_col_tiles(k);
  return resident / col_tiles * col_tiles * C;
}

// Whether the handshake kernel applies: where the warpgroup kernel does, with cooperative
// launches, a grid that holds a row block's tiles, and tiles enough to keep at least half
// of the multiprocessors busy (fewer rows are left to cuBLAS, which splits them finer).
template <typename T, bool TRANS>
bool handshake_applies(const Args<T>& a, const DeviceInfo& d) {
  if (!wgmma_applies(a, d) || !d.coop) return false;
  const int grid = with_handshake_tile(
      a.k, [&](auto tile) { return handshake_grid<T, TRANS, decltype(tile)>(a.k); });
  return grid > 0 && 2 * handshake_row_blocks(a.rows) * handshake_col_tiles(a.k) >= d.sm_count;
}

// Launches the handshake kernel (handshake_applies holds) in launches of at most INT_MAX / BM
// - 1 row blocks, so that the tensor maps' row coordinates stay 32-bit.
template <typename T, bool TRANS, class Tile>
cudaError_t launch_handshake(Args<T> a, int* counters, cudaStream_t stream) {
  const auto kernel = handshake_kernel_of<T, TRANS, Tile>();
  const int grid = handshake_grid<T, TRANS, Tile>(a.k);
  const int64_t col_tiles = handshake_col_tiles(a.k);
  const int64_t row_blocks = ceil_div(a.rows, Tile::BM), total_rows = a.rows;
  constexpr int64_t kPerLaunch = INT_MAX / Tile::BM - 1;
  // The kernel's shared memory limit was raised by handshake_grid, for this device.
  cudaError_t err = cudaSuccess;
  for (int64_t first = 0; err == cudaSuccess && first < row_blocks; first += kPerLaunch) {
    const int64_t blocks = std::min(row_blocks - first, kPerLaunch);
    const int64_t row0 = first * Tile::BM;
    a.first_block = first;
    a.rows = std::min(total_rows - row0, blocks * Tile::BM);  // this launch's
    TmaMaps maps;
    err = make_maps<T, TRANS, Tile>(a, row0, a.rows, 1, &maps);
    if (err != cudaSuccess) break;
    constexpr int C = Tile::kWParts;
    const int64_t ctas = std::min<int64_t>(grid, ceil_div(blocks, int64_t{C}) * col_tiles * C);
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg =
        handshake_config<Tile>(static_cast<unsigned>(ctas), stream, attrs);
    err = cudaLaunchKernelEx(&cfg, kernel, a, maps, counters);
  }
  return err == cudaSuccess ? cudaGetLastError() : err;
}

// Blocks of few_rows_kernel<T, TRANS, NA, MT> of `warps` warps (4, 8 or 16) resident at once
// on the current device. The kernel's shared memory limit is raised to what its largest
// blocks need, or as far as the device allows (blocks that need more are not resident), the
// same for every size asked, so that no later question lowers it under an earlier answer.
template <typename T, bool TRANS, int NA, int MT>
int few_rows_resident(int warps, const DeviceInfo& d) {
  static std::atomic<int> cache[3][kMaxDevices];
  return once_per_device(cache[warps == 4 ? 0 : warps == 8 ? 1 : 2], [&](int) {
    const size_t smem = few_rows_smem<NA, MT>(warps), optin = d.smem_optin;
    if (smem > optin) return 0;
    return occupancy_units(&few_rows_kernel<T, TRANS, NA, MT>, warps * 32, 1, smem, d.sm_count,
                           std::min(few_rows_smem<NA, MT>(few_warps_max<MT>()), optin));
  });
}

// A cooperative launch of one block per BN columns, with as many warps per block (halving
// from few_warps_max) as keep the grid within about 16 warps per multiprocessor (more split K
// finer, fewer let more blocks fit at once); cudaErrorCooperativeLaunchTooLarge, launching
// nothing, where the blocks do not all fit at once even with kFewWarpsMin warps. (Splitting
// K further, over clusters of 2-8 blocks that summed their partial sums in one block's
// shared memory, ran 2-39% slower at K = 1024-4096: H100, fp16/bf16, 1 and 16 rows.)
template <typename T, bool TRANS, int NA, int MT>
cudaError_t launch_few_rows(const Args<T>& a, const DeviceInfo& d, cudaStream_t stream) {
  const int64_t grid = ceil_div(a.k, 16 * NA);
  int warps = few_warps_max<MT>();
  while (warps > kFewWarpsMin && grid * warps > 16 * d.sm_count) warps /= 2;
  while (warps >= kFewWarpsMin && grid > few_rows_resident<T, TRANS, NA, MT>(warps, d))
    warps /= 2;
  if (warps < kFewWarpsMin) return cudaErrorCooperativeLaunchTooLarge;
  void* args[] = {const_cast<Args<T>*>(&a)};
  const cudaError_t err = cudaLaunchCooperativeKernel(
      reinterpret_cast<const void*>(&few_rows_kernel<T, TRANS, NA, MT>),
      dim3(static_cast<unsigned>(grid)), dim3(warps * 32), args, few_rows_smem<NA, MT>(warps),
      stream);
  return err == cudaSuccess ? cudaGetLastError() : err;
}

// The launch for a.rows rows in MT tiles of 8.
template <typename T, bool TRANS, int NA>
cudaError_t launch_few_rows_tiles(const Args<T>& a, const DeviceInfo& d, cudaStream_t stream) {
  if (a.rows <= 8) return launch_few_rows<T, TRANS, NA, 1>(a, d, stream);
  if (a.rows <= 16) return launch_few_rows<T, TRANS, NA, 2>(a, d, stream);
  if (a.rows <= 32) return launch_few_rows<T, TRANS, NA, 4>(a, d, stream);
  return launch_few_rows<T, TRANS, NA, 8>(a, d, stream);
}

// The block's 16-column tiles NA (H100, fp16/bf16, per-call times in turns in one build;
// stops 40, 41 and 45 in benchmarks/results/square_matmul_overlap.md):
// - x @ W: 1 (each thread's W loads 4-byte chunks, twice the blocks of 2) for one tile of
//   rows up to K = 2048: one row at K = 2048 took 12.3-12.8 us against 13.3-13.7 with 2, but
//   16 rows lost 0.3-0.4 us at K = 1024 with it. And 1 for 17-64 rows (the zero-workspace
//   mode) up to K = 1024: 7-11% faster there (three sweeps per arm, fp16 and bf16, with and
//   without bias; 64 rows 13.9-15.0 us against 15.3-16.4), but at K = 2048 even at 17 rows
//   and up to 5% slower at 32-64 (stop 46). Else 2 (8-byte chunks) up to K = 2048, and up
//   to 4096 from 17 rows; beyond, 4 (16-byte chunks in half the blocks), with which up to 16
//   rows ran 9-16% slower at K = 1024 and 17-64 rows 5-24% slower at K <= 4096, but 2 was
//   7-10% slower at K = 4096 (up to 16 rows) and up to 12% at K = 8192 (64 rows).
// - x @ W^T: 1, the most blocks, or 2 where those do not all fit at once; from 17 rows past
//   K = 4096, 4 (2 was up to 12% slower at 64 rows, K = 8192).
template <typename T, bool TRANS>
cudaError_t launch_few_rows_any(const Args<T>& a, const DeviceInfo& d, cudaStream_t stream) {
  const bool many = a.rows > 16;
  if constexpr (!TRANS) {
    if ((a.rows <= 8 && a.k <= 2048) || (many && a.k <= 1024)) {
      const cudaError_t err = launch_few_rows_tiles<T, TRANS, 1>(a, d, stream);
      if (err != cudaErrorCooperativeLaunchTooLarge) return err;
    }
    return a.k <= (many ? 4096 : 2048) ? launch_few_rows_tiles<T, TRANS, 2>(a, d, stream)
                                       : launch_few_rows_tiles<T, TRANS, 4>(a, d, stream);
  } else {
    if (many && a.k > 4096) return launch_few_rows_tiles<T, TRANS, 4>(a, d, stream);
    const cudaError_t err = launch_few_rows_tiles<T, TRANS, 1>(a, d, stream);
    return err == cudaErrorCooperativeLaunchTooLarge
               ? launch_few_rows_tiles<T, TRANS, 2>(a, d, stream)
               : err;
  }
}

}  // namespace

template <typename T>
cudaError_t square_matmul_zero_ws_max_k(int64_t* max_k) {
  DeviceInfo d;
  const cudaError_t err = current_device(&d);
  if (err != cudaSuccess) return err;
  *max_k = use_tensor_cores<T>(d) ? family_max_k(MmaTiles{}, sizeof(T), d.smem_optin)
                                  : family_max_k(FmaTiles{}, sizeof(T), d.smem_optin);
  return cudaSuccess;
}

template <typename T>
cudaError_t square_matmul_zero_ws(T* x, const RowLayout& layout, const T* w, const T* bias,
                                  bool transpose, cudaStream_t stream) {
  if (layout.rows == 0 || layout.n == 0) return cudaSuccess;
  DeviceInfo d;
  cudaError_t err = current_device(&d);
  if (err != cudaSuccess) return err;
  const bool mma = use_tensor_cores<T>(d);
  const int64_t max_k = mma ? family_max_k(MmaTiles{}, sizeof(T), d.smem_optin)
                            : family_max_k(FmaTiles{}, sizeof(T), d.smem_optin);
  if (layout.n > max_k) return cudaErrorInvalidValue;

  const Args<T> a = make_args(x, layout, w, bias, mma);
  if constexpr (sizeof(T) == 2) {
    if (mma && d.cc >= 90 && a.x_vec && a.w_vec) {
      bool launched = false;
      if (wgmma_applies(a, d)) {
        err = transpose ? launch_stream<T, true>(WgmmaTiles{}, a, d, stream, &launched)
                        : launch_stream<T, false>(WgmmaTiles{}, a, d, stream, &launched);
        if (err != cudaSuccess || launched) return err;
      }
      err = transpose ? launch_stream<T, true>(StreamTiles{}, a, d, stream, &launched)
                      : launch_stream<T, false>(StreamTiles{}, a, d, stream, &launched);
      if (err != cudaSuccess || launched) return err;
    }
    if (mma)
      return transpose ? launch_family<T, true>(MmaTiles{}, a, d, stream)
                       : launch_family<T, false>(MmaTiles{}, a, d, stream);
  }
  return transpose ? launch_family<T, true>(FmaTiles{}, a, d, stream)
                   : launch_family<T, false>(FmaTiles{}, a, d, stream);
}

template <typename T>
cudaError_t square_matmul_few_rows(T* x, const RowLayout& layout, const T* w, const T* bias,
                                   bool transpose, cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorNotSupported;  // asked on every call: no device queries for other types
  } else {
    // K in whole steps (FewRowsStep::KS).
    if (layout.rows < 1 || layout.rows > kFewRowsMax || layout.n == 0 ||
        layout.n % (transpose ? 32 : 16) != 0)
      return cudaErrorNotSupported;
    DeviceInfo d;
    const cudaError_t err = current_device(&d);
    if (err != cudaSuccess) return err;
    const Args<T> a = make_args(x, layout, w, bias, /*mma=*/true);
    if (!use_tensor_cores<T>(d) || !d.coop || !a.x_vec || !a.w_vec) return cudaErrorNotSupported;
    return transpose ? launch_few_rows_any<T, true>(a, d, stream)
                     : launch_few_rows_any<T, false>(a, d, stream);
  }
}

bool square_matmul_few_rows_suits(int64_t rows, int64_t k, bool transpose, bool workspace) {
  if (!workspace) return true;
  return rows <= 16 && k <= 4096 && (transpose || rows <= 8 || k <= 1024);
}

template <typename T>
int64_t square_matmul_handshake_counters(const T* x, const RowLayout& layout, const T* w,
                                         bool transpose) {
  if constexpr (sizeof(T) != 2) {
    return 0;  // asked on every default-path call: no device queries for other types
  } else {
    DeviceInfo d;
    if (layout.rows == 0 || layout.n == 0 || current_device(&d) != cudaSuccess) return 0;
    const Args<T> a = make_args<T>(const_cast<T*>(x), layout, w, nullptr, /*mma=*/true);
    const bool applies = transpose ? handshake_applies<T, true>(a, d)
                                   : handshake_applies<T, false>(a, d);
    return applies ? handshake_row_blocks(layout.rows) : 0;
  }
}

template <typename T>
cudaError_t square_matmul_handshake(T* x, const RowLayout& layout, const T* w, const T* bias,
                                   bool transpose, int* counters, bool counters_zero,
                                   cudaStream_t stream) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    // make_args's mma only sets the staging kernels' row pitch, which this kernel ignores.
    const Args<T> a = make_args(x, layout, w, bias, /*mma=*/true);
    // Zeroed on the stream rather than by the kernel's CTAs before a grid barrier: H100, bf16,
    // per-call times in turns with torch.matmul, the grid barrier cost more than this memset,
    // e.g. K = 1024, M = 4096: 21.9 us against 21.4; K = 4096, M = 1024: 52.9 against 51.7.
    if (!counters_zero) {
      const cudaError_t err =
          cudaMemsetAsync(counters, 0, handshake_row_blocks(layout.rows) * sizeof(int), stream);
      if (err != cudaSuccess) return err;
    }
    return with_handshake_tile(a.k, [&](auto tile) {
      using Tile = decltype(tile);
      return transpose ? launch_handshake<T, true, Tile>(a, counters, stream)
                       : launch_handshake<T, false, Tile>(a, counters, stream);
    });
  }
}

template cudaError_t square_matmul_zero_ws<float>(float*, const RowLayout&, const float*,
                                                  const float*, bool, cudaStream_t);
template cudaError_t square_matmul_zero_ws<__half>(__half*, const RowLayout&, const __half*,
                                                   const __half*, bool, cudaStream_t);
template cudaError_t square_matmul_zero_ws<__nv_bfloat16>(__nv_bfloat16*, const RowLayout&,
                                                          const __nv_bfloat16*,
                                                          const __nv_bfloat16*, bool,
                                                          cudaStream_t);
template cudaError_t square_matmul_zero_ws_max_k<float>(int64_t*);
template cudaError_t square_matmul_zero_ws_max_k<__half>(int64_t*);
template cudaError_t square_matmul_zero_ws_max_k<__nv_bfloat16>(int64_t*);

#define MTI_INSTANTIATE_HANDSHAKE(T)                                                       \
  template cudaError_t square_matmul_few_rows<T>(T*, const RowLayout&, const T*, const T*,   \
                                                 bool, cudaStream_t);                       \
  template int64_t square_matmul_handshake_counters<T>(const T*, const RowLayout&, const T*, \
                                                       bool);                                \
  template cudaError_t square_matmul_handshake<T>(T*, const RowLayout&, const T*, const T*, \
                                                  bool, int*, bool, cudaStream_t);
MTI_INSTANTIATE_HANDSHAKE(float)
MTI_INSTANTIATE_HANDSHAKE(__half)
MTI_INSTANTIATE_HANDSHAKE(__nv_bfloat16)
#undef MTI_INSTANTIATE_HANDSHAKE

}  // namespace mti
