// mbarriers (sm_90+): 8-byte shared-memory barriers that count thread arrivals and, for
// asynchronous copies (st.async, the TMA), bytes; addressed by their shared-memory address
// (smem_u32). Shared by the cluster reduction (kernels/rowwise/reduce.cuh) and the warpgroup matmul
// kernels (kernels/square_matmul/). Below sm_90 the helpers are empty and never called.
#pragma once

#include <cstdint>

namespace mti {

// Device code for sm_90+, which has mbarriers and thread-block clusters (kernels/rowwise/reduce.cuh's
// cluster code uses it too).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MTI_MBARRIER 1
#else
#define MTI_MBARRIER 0
#endif

// The address of the same shared-memory location in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t map_to_rank(uint32_t address, uint32_t rank) {
  uint32_t mapped = address;
#if MTI_MBARRIER
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(address), "r"(rank));
#endif
  return mapped;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
#if MTI_MBARRIER
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
#endif
}

// Makes the initialised barriers visible to the cluster's other CTAs (and to the async
// proxy) before a cluster barrier lets them arrive on them or copy into this CTA.
__device__ __forceinline__ void mbar_init_fence() {
#if MTI_MBARRIER
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrives once and adds `bytes` to the transfers the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if MTI_MBARRIER
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

// Arrives on the barrier at the same shared address in CTA `rank` of the cluster (this CTA
// too). The arrive's default release is at CTA scope: enough where what it orders has already
// been seen complete (the warpgroup kernel's MMAs' reads of a stage, after wgmma_wait). A
// cluster-scope release (.release.cluster) would wait for the thread's every earlier write
// to reach the cluster, which slows the warpgroup kernel down.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
#if MTI_MBARRIER
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(map_to_rank(bar, rank))
               : "memory");
#endif
}

// Arrives on a barrier of this CTA (release at CTA scope, as mbar_arrive_cluster's).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if MTI_MBARRIER
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// Waits until the phase of parity `parity` has completed (parity 1 passes at once on a
// fresh barrier: its phase 0 is the one in progress).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if MTI_MBARRIER
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

}  // namespace mti
