// What the warpgroup kernels (wgmma_stream.cu, handshake.cu; fp16/bf16, sm_90a builds on
// sm_90) share: their tile, the TMA loads of its stages and the stages' mbarriers, the MMAs
// on a stage (wgmma.cuh), and on the host the tensor maps that describe x and W to the TMA.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/mbarrier.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/wgmma.cuh"

namespace mti::square_matmul {

// The most shared memory a block may opt into on sm_90, the only architecture that runs the
// warpgroup kernels.
constexpr int kSm90SmemOptin = 227 * 1024;

// Column tiles of BN = 256 and row blocks of BM = 128; a k step of BK = 64 (one 128-byte
// swizzled row of x and W per row) is four m64n256k16 MMAs for each of two consumer
// warpgroups, each accumulating a 64 x 256 fp32 tile, fed by a producer warp STAGES steps
// ahead.
template <int STAGES>
struct WgmmaTile {
  static constexpr int BM = 128;
  static constexpr int BN = 256;
  static constexpr int BK = kSwizzleBytes / 2;  // one swizzle row of 16-bit elements
  static constexpr int kConsumers = 2;          // warpgroups of MMAs, 64 rows each
  static constexpr int THREADS = 128 * (kConsumers + 1);
  static constexpr int kStages = STAGES;
  static constexpr int A_BYTES = BM * BK * 2;
  static constexpr int STAGE = BM * BK + BK * BN;  // elements
  static constexpr int kOutPad = 8;                // as StreamTile's
  static constexpr int LAST_LD = BN + kOutPad;
  static constexpr int kBlocksPerSm = 1;
  static constexpr int kMaxCluster = kWgmmaMaxCluster;
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
__device__ __forceinline__ void mma_stage(float (&acc)[128], uint32_t st, int c, bool accumulate) {
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

// ---------------------------------------------------------------------------------------
// Host side.

// The driver's cuTensorMapEncodeTiled (through the runtime, so nothing links libcuda), or
// nullptr where the driver lacks it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
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
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
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
  const bool ok = encode_map(&m->x, a.x + a.row.offset(row0), a.k, rows, round_up(pitch, 16),
                             Tile::BK, Tile::BM / cluster) &&
                  encode_map(&m->w, a.w, a.k, a.k, a.k * sizeof(T), Tile::BK,
                             TRANS ? Tile::BN / Tile::kWParts : Tile::BK);
  return ok ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace mti::square_matmul
