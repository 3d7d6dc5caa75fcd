// square_matmul_'s GPU-dependent choices: one table per run-time parameter (read through
// tuned(), kernels/tuning.h; the tuning command's cases for them are in
// make_torch_inplace/tune/square_matmul.py), then the compile-time shapes its kernels are
// built for. Every table is keyed on the GPU and K (the key's n).
#pragma once

#include "kernels/tuning.h"

namespace mti::square_matmul {

// ---------------------------------------------------------------------------------------
// Which kernel runs (select.cu).

// Where the workspace holds the output, so that cuBLAS's GEMM into a fresh output plus a copy
// back over x is the alternative: the most rows for which the few-rows kernel runs first
// (x @ W, and x @ W^T). Without such a workspace it takes any rows it is built for.
inline constexpr TuningRow kFewRowsFirstXwRows[] = {
    {When{.n_max = 1024}, 16, "up to 16 rows it outruns cuBLAS + the copy back on an H100"},
    {When{.n_max = 4096}, 8, "9-16 rows lose to cuBLAS past K = 1024 on an H100"},
    {When{}, 0, "past K = 4096 cuBLAS + the copy back is as fast or faster on an H100"},
};
inline constexpr TuningRow kFewRowsFirstXwtRows[] = {
    {on_h200(When{.elem_bytes = 2, .n_max = 2048}), 32,
     "32 rows ran 2-3x faster than cuBLAS + the copy back (H200)"},
    {When{.n_max = 4096}, 16, "up to 16 rows it outruns cuBLAS + the copy back on an H100"},
    {When{}, 0, "past K = 4096 cuBLAS + the copy back is as fast or faster on an H100"},
};
static_assert(ends_in_catch_all(kFewRowsFirstXwRows) && ends_in_catch_all(kFewRowsFirstXwtRows));
inline constexpr Tunable kFewRowsFirstXw =
    tunable("square_matmul.few_rows_first.xw", kFewRowsFirstXwRows);
inline constexpr Tunable kFewRowsFirstXwt =
    tunable("square_matmul.few_rows_first.xwt", kFewRowsFirstXwtRows);

// ---------------------------------------------------------------------------------------
// The few-rows kernel (few_rows.cu).

// 16-column tiles per block (1, 2 or 4; 1 becomes 2 where its blocks do not all fit at once),
// by layout of W and rows (up to 8, 16 or 64). More tiles load W in wider chunks in fewer
// blocks; fewer split K finer over more blocks.
inline constexpr TuningRow kFewRowsTilesXw8Rows[] = {
    {When{.n_max = 2048}, 1, "4-byte W loads in the most blocks: fastest on an H100"},
    {When{}, 4, "16-byte W loads in a quarter of the blocks: fastest on an H100"},
};
inline constexpr TuningRow kFewRowsTilesXw16Rows[] = {
    {When{.n_max = 2048}, 2, "8-byte W loads: fastest on an H100"},
    {When{}, 4, "16-byte W loads in half the blocks: fastest on an H100"},
};
inline constexpr TuningRow kFewRowsTilesXw64Rows[] = {
    {When{.n_max = 1024}, 1, "4-byte W loads in the most blocks: fastest on an H100"},
    {When{.n_max = 4096}, 2, "8-byte W loads: fastest on an H100"},
    {When{}, 4, "16-byte W loads in half the blocks: fastest on an H100"},
};
inline constexpr TuningRow kFewRowsTilesXwt16Rows[] = {
    {When{}, 1, "the most blocks, each splitting K among its warps: fastest on an H100"},
};
inline constexpr TuningRow kFewRowsTilesXwt64Rows[] = {
    {on_h200(When{.elem_bytes = 2, .n_min = 4096, .n_max = 4096}), 2, "5% faster (H200)"},
    {When{.n_max = 4096}, 1, "the most blocks, each splitting K among its warps (H100)"},
    {When{}, 4, "fewer blocks, each reading x's rows for more columns: fastest on an H100"},
};
static_assert(ends_in_catch_all(kFewRowsTilesXw8Rows) && ends_in_catch_all(kFewRowsTilesXw16Rows) &&
              ends_in_catch_all(kFewRowsTilesXw64Rows) &&
              ends_in_catch_all(kFewRowsTilesXwt16Rows) &&
              ends_in_catch_all(kFewRowsTilesXwt64Rows));
inline constexpr Tunable kFewRowsTilesXw8 =
    tunable("square_matmul.few_rows_tiles.xw.8", kFewRowsTilesXw8Rows);
inline constexpr Tunable kFewRowsTilesXw16 =
    tunable("square_matmul.few_rows_tiles.xw.16", kFewRowsTilesXw16Rows);
inline constexpr Tunable kFewRowsTilesXw64 =
    tunable("square_matmul.few_rows_tiles.xw.64", kFewRowsTilesXw64Rows);
inline constexpr Tunable kFewRowsTilesXwt16 =
    tunable("square_matmul.few_rows_tiles.xwt.16", kFewRowsTilesXwt16Rows);
inline constexpr Tunable kFewRowsTilesXwt64 =
    tunable("square_matmul.few_rows_tiles.xwt.64", kFewRowsTilesXwt64Rows);

// Warps per multiprocessor that the grid's blocks may add up to: a block has as many warps
// (halving from the most its registers allow, down to 4) as keep it within this.
inline constexpr TuningRow kFewRowsWarpsPerSmRows[] = {
    {When{}, 16, "more warps split K finer, fewer let more blocks be resident at once (H100)"},
};
static_assert(ends_in_catch_all(kFewRowsWarpsPerSmRows));
inline constexpr Tunable kFewRowsWarpsPerSm =
    tunable("square_matmul.few_rows_warps_per_sm", kFewRowsWarpsPerSmRows);

// ---------------------------------------------------------------------------------------
// The handshake kernel (handshake.cu).

// CTAs per cluster (1 or 2), which share each W tile, each loading its part for both.
inline constexpr TuningRow kHandshakeClusterRows[] = {
    {When{.n_min = 4096}, 2, "from K = 4096 L2 bounds it: sharing W tiles halves its W loads"},
    {When{}, 1, "below, the clusters' barriers cost more than the shared loads save (H100)"},
};
static_assert(ends_in_catch_all(kHandshakeClusterRows));
inline constexpr Tunable kHandshakeCluster =
    tunable("square_matmul.handshake_cluster", kHandshakeClusterRows);

// ---------------------------------------------------------------------------------------
// The zero-workspace kernels' cost models, which pick their tile and split (mma.cu, fma.cu,
// stream.cu, wgmma_stream.cu).

// What streaming one W tile from L2 costs in rows of arithmetic on it, for the mma.sync and
// the FMA staging kernels.
inline constexpr TuningRow kMmaWCostRows[] = {
    {When{}, 32, "an SM takes ~32 bytes per clock from L2 and does ~1024 mma.sync flops (H100)"},
};
inline constexpr TuningRow kFmaWCostRows[] = {
    {When{}, 16, "~32 bytes per clock from L2 against ~256 FFMA flops, with 4-byte W elements"},
};
// Rows of x and W streamed from L2 that cost as much as one row of MMAs of a streaming
// kernel's 256-column tile.
inline constexpr TuningRow kStreamLoadRowsRows[] = {
    {When{}, 8, "a row's load costs a quarter of a 128-column row of MMAs (mma_w_cost)"},
};
static_assert(ends_in_catch_all(kMmaWCostRows) && ends_in_catch_all(kFmaWCostRows) &&
              ends_in_catch_all(kStreamLoadRowsRows));
inline constexpr Tunable kMmaWCost = tunable("square_matmul.mma_w_cost", kMmaWCostRows);
inline constexpr Tunable kFmaWCost = tunable("square_matmul.fma_w_cost", kFmaWCostRows);
inline constexpr Tunable kStreamLoadRows =
    tunable("square_matmul.stream_load_rows", kStreamLoadRowsRows);

// ---------------------------------------------------------------------------------------
// cuBLAS's chunks of rows through the workspace (csrc/cuda/square_matmul.cu).

// The bytes of output a chunk aims at, where the workspace holds two such chunks: their
// copies back then overlap the GEMMs of the next chunks.
inline constexpr TuningRow kChunkBytesRows[] = {
    {on_h200(When{.elem_bytes = 4, .n_max = 4096}), 16 << 20,
     "fp32 K = 1024-4096 ran 6-24% faster (H200)"},
    {When{}, 32 << 20, "half the default workspace: smaller chunks are many small GEMMs (H100)"},
};
// The fewest rows a chunk aims at: every chunk's GEMM reads all of W again, and with r rows it
// does r flops per byte of a 2-byte W.
inline constexpr TuningRow kChunkMinRowsRows[] = {
    {When{}, 1024, "well above the ridge point (~300 flop/byte, bf16 on an H100) at any K"},
};
static_assert(ends_in_catch_all(kChunkBytesRows) && ends_in_catch_all(kChunkMinRowsRows));
inline constexpr Tunable kChunkBytes = tunable("square_matmul.chunk_bytes", kChunkBytesRows);
inline constexpr Tunable kChunkMinRows = tunable("square_matmul.chunk_min_rows", kChunkMinRowsRows);

// ---------------------------------------------------------------------------------------
// Compile-time shapes: the kernels are instantiated for these.

// k extent of the mma.sync and FMA kernels' W (and x) tiles: 64-byte rows of 16-bit elements,
// which the ldmatrix swizzle pairs into 128 bytes (w_index).
constexpr int kBK = 32;
// W (and x) tiles in flight in the mma.sync kernels' cp.async pipelines: enough to cover the
// latency of L2 on an H100.
constexpr int kStages = 4;
// Rows the few-rows kernel is built for (up to 8 tiles of 8): beyond, x's rows, read by every
// block, outweigh its W columns.
constexpr int kFewRowsMax = 64;
// The largest cluster every sm_90 part schedules (the portable size).
constexpr int kStreamMaxCluster = 8;
// The largest cluster an H100 schedules (non-portable); parts that schedule fewer refuse the
// larger sizes at run time, and the smaller ones run.
constexpr int kWgmmaMaxCluster = 16;
// The handshake kernel's stages, and the staging tile beside them in boxes of 64 columns (an
// output tile goes out in 256 / (64 * boxes) parts): the fourth stage fits beside half a tile.
constexpr int kHandshakeStages = 4;
constexpr int kHandshakeOutBoxes = 2;

template <class... Tiles>
struct TileList {};
template <int BM, int WARPS_R>
struct MmaTile;  // mma.cu
template <int BM>
struct FmaTile;  // fma.cu
template <int MT>
struct StreamTile;  // stream.cu
template <int STAGES>
struct WgmmaTile;  // wgmma_tile.cuh

// The staging kernels' rows per block, most first: a block's rows of all K columns must fit in
// shared memory (on an H100, 16-bit rows: 96 at K = 1024, 48 at 2048, 24 at 4096, 8 at 8192),
// and the more rows a block owns, the more output each W tile read from L2 feeds.
using MmaTiles = TileList<MmaTile<128, 2>, MmaTile<96, 2>, MmaTile<64, 2>, MmaTile<48, 1>,
                          MmaTile<32, 1>, MmaTile<24, 1>, MmaTile<16, 1>, MmaTile<8, 1>>;
using FmaTiles = TileList<FmaTile<64>, FmaTile<32>, FmaTile<16>, FmaTile<8>>;
// The streaming kernel's row blocks: 128 rows, or 64 where that splits the rows finer.
using StreamTiles = TileList<StreamTile<4>, StreamTile<2>>;
// The warpgroup streaming kernel's stages: four where they fit beside the parked tiles (one
// column tile per block), else three.
using WgmmaTiles = TileList<WgmmaTile<4>, WgmmaTile<3>>;

}  // namespace mti::square_matmul
