// Hopper warpgroup MMA (wgmma, sm_90a only): the descriptors of operands in shared memory,
// the m64n256k16 instruction with fp32 accumulators, and the fences around it; and what feeds
// it: the tensor memory accelerator's tile loads (TMA, with multicast to a cluster), which
// complete mbarriers (kernels/mbarrier.cuh), and the register split between producer and
// consumer warpgroups.
// Device code here compiles only for an arch-specific target (TORCH_CUDA_ARCH_LIST "9.0a",
// which defines __CUDA_ARCH_FEAT_SM90_ALL); elsewhere these helpers are empty and never
// called.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mti {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MTI_WGMMA 1
#else
#define MTI_WGMMA 0
#endif

// Operand tiles use the 128-byte swizzle: rows of 128 bytes (64 16-bit elements), the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8), as the TMA writes them
// (CU_TENSOR_MAP_SWIZZLE_128B); the pattern repeats every 8 rows (1024 bytes), from a
// 1024-byte aligned address.
constexpr int kSwizzleBytes = 128;

// Shared memory matrix descriptor of such an operand at shared address `addr`: `lead` and
// `stride` are the byte distances that the PTX ISA calls leading and stride dimension offsets.
// K-major (rows of 64 k): stride = 1024 (from 8 rows to the next 8), lead unused. MN-major
// (rows of 64 m or n, one per k): lead = from a 64-column block to the next, stride = from 8
// k-rows to the next 8.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) |
         static_cast<uint64_t>((lead >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride >> 4) & 0x3FFF) << 32 |
         uint64_t{1} << 62;  // layout type: 128-byte swizzle
}

// Before a warpgroup's first wgmma on registers that other instructions wrote or read.
__device__ __forceinline__ void wgmma_fence() {
#if MTI_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if MTI_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most N of the warpgroup's committed wgmma groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if MTI_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// d (64 x 256 per warpgroup, fp32) = A (64 x 16, K-major) * B (16 x 256) + (accumulate ? d : 0).
// kTransB: B is MN-major (rows of n). Thread t of the warpgroup holds, for each n8 block i,
// d[4i], d[4i + 1] at row 16 (t / 32) + t % 32 / 4, columns 8i + 2 (t % 4) + {0, 1}, and
// d[4i + 2], d[4i + 3] eight rows below.
#define MTI_WGMMA_M64N256K16(PTX_TYPE)                                                             \
  asm volatile(                                                                                    \
      "{\n"                                                                                        \
      ".reg .pred p;\n"                                                                            \
      "setp.ne.b32 p, %130, 0;\n"                                                                  \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX_TYPE "." PTX_TYPE                         \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"            \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"            \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"            \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"            \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"            \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "     \
      "%111,"                                                                                      \
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, " \
      "%127"                                                                                       \
      "}, %128, %129, p, 1, 1, 0, %131;\n"                                                         \
      "}\n"                                                                                        \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), \
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), \
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])         \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransB ? 1 : 0))

template <typename T, bool kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#if MTI_WGMMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    MTI_WGMMA_M64N256K16("bf16");
  else
    MTI_WGMMA_M64N256K16("f16");
#endif
}
#undef MTI_WGMMA_M64N256K16

// ---------------------------------------------------------------------------------------
// TMA: a box of a 2-D tensor map (coordinates innermost first, in elements; zeros where the
// box leaves the tensor) into shared memory at dst, counted in bytes on barrier bar. The
// multicast form writes the box at the same offset in every block of the cluster in
// cta_mask and completes each one's barrier at bar's offset.

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
#if MTI_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}

__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int c0,
                                                      int c1, uint32_t bar, uint16_t cta_mask) {
#if MTI_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
#endif
}

// TMA stores: a box of shared memory at src (laid out as a load of the same map would leave
// it) to the tensor at (c0, c1), parts outside the tensor left out; in bulk groups. The
// source must not be rewritten before the group's reads are done (bulk_wait_read), nor the
// CTA exit before its writes are (bulk_wait).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int c0, int c1, uint32_t src) {
#if MTI_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(c0), "r"(c1), "r"(src)
      : "memory");
#endif
}

__device__ __forceinline__ void bulk_commit() {
#if MTI_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until no committed bulk group of this thread still reads its source.
__device__ __forceinline__ void bulk_wait_read() {
#if MTI_WGMMA
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// Waits until every committed bulk group of this thread is complete.
__device__ __forceinline__ void bulk_wait() {
#if MTI_WGMMA
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

// Orders this thread's generic-proxy accesses of shared memory (writes for a TMA store to
// read) before its later async-proxy ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if MTI_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The same for global memory: what this thread has seen (an acquire) before its TMA stores.
__device__ __forceinline__ void fence_proxy_async_global() {
#if MTI_WGMMA
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Gives up (dec) or claims (inc) registers for the executing warpgroup, so that the MMA
// warpgroups can hold more than an even share of the register file.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if MTI_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if MTI_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Named barrier `id` (1-15; 0 is __syncthreads) among `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace mti
