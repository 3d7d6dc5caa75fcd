// mma.sync on 16-bit operands (sm_80+, fp16 also sm_75), as the staging and streaming kernels
// use it: ldmatrix, the m16n8k16 MMA with fp32 accumulators, and W tiles staged in shared
// memory by cp.async in the swizzled layout that ldmatrix reads without bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"

namespace mti::square_matmul {

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

}  // namespace mti::square_matmul
