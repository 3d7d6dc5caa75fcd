// The rope_ kernel's GPU-dependent choices (compile-time; none of them measured on a GPU yet:
// each is a candidate for a runtime table of kernels/tuning.h once the tuning command times it).
#pragma once

namespace mti {

// CTA size: 8 warps, so that an SM holds several CTAs and a CTA's rows of one sequence
// position share cos/sin rows in L1.
constexpr int kRopeThreads = 256;
// Rows a thread has in flight per step (all its loads issued before its first store): at 4
// CTAs per SM, 1024 threads keep 32 KiB of x (and as much of cos and sin) in flight per SM,
// more than an H100/H200 SM needs to cover DRAM latency at full bandwidth. Two rows held the
// 16-bit types' converted values past 80 registers and spilled.
constexpr int kRopeRowsPerThread = 1;
// CTAs per SM the kernel is compiled to fit: 64 registers a thread, which no instantiation
// exceeds (ptxas, sm_75 to sm_90a).
constexpr int kRopeMinCtasPerSm = 4;
// Threads that share a row at most (one warp); a row with more 16-byte chunks per half takes
// several steps of each thread.
constexpr int kRopeMaxThreadsPerRow = 32;

}  // namespace mti
