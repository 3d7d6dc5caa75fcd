// Torch-free launchers of square_matmul_'s own kernels: x <- x @ W (+ bias) written over x.
// The zero-workspace kernel uses no device memory beyond x, W and bias; the handshake kernel
// (sm_90a, the default path's where it applies, declared below) an int per 128 rows.
//
// Each thread block (on sm_90, for fp16/bf16, each cluster of blocks) owns whole rows of x and
// keeps on chip either the rows' inputs or its share of their outputs until every input
// element of the rows has been read, so it can overwrite them in global memory. That bounds K
// by shared memory; square_matmul_zero_ws_max_k says how far on the current device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti {

// x: layout.rows rows of K = layout.n elements, neighbours in a row adjacent (col_stride 1),
// row r starting at x + layout.row.offset(r); rows must not overlap each other, W or bias.
// w: (K, K) contiguous. bias: K elements, or nullptr for none. transpose: multiply by W^T.
// T is float, __half or __nv_bfloat16; accumulation is fp32 (full fp32 FMA for float).
// Runs on `stream` on the current device. Returns cudaErrorInvalidValue, launching nothing,
// when K > square_matmul_zero_ws_max_k<T>; otherwise the launch's error.
template <typename T>
cudaError_t square_matmul_zero_ws(T* x, const RowLayout& layout, const T* w, const T* bias,
                                  bool transpose, cudaStream_t stream);

// The largest K that square_matmul_zero_ws<T> accepts on the current device (either
// transpose), from its shared memory per block.
template <typename T>
cudaError_t square_matmul_zero_ws_max_k(int64_t* max_k);

// The kernel for fp16/bf16 with 1 to 64 rows (decoding) on GPUs with their tensor cores,
// where K is a multiple of 16 (x @ W) or 32 (x @ W^T) and x's rows and W are in 16-byte
// chunks: blocks of output columns over all the rows, bound by reading W once, which write
// over x after a grid-wide sync; no memory beyond x, W and bias. Arguments as
// square_matmul_zero_ws's. Returns cudaErrorNotSupported, or
// cudaErrorCooperativeLaunchTooLarge (its blocks would not all be resident at once: K too
// large, or under MPS), launching nothing, where it does not apply; otherwise the launch's
// error.
template <typename T>
cudaError_t square_matmul_few_rows(T* x, const RowLayout& layout, const T* w, const T* bias,
                                   bool transpose, cudaStream_t stream);

// Whether square_matmul_few_rows, where it applies, is the kernel to run (H100, fp16/bf16).
// workspace: the output fits in the workspace, so that cuBLAS's GEMM into a fresh output plus
// a copy back over x is the alternative: then up to 16 rows and K = 4096, for x @ W^T, and
// for x @ W up to 8 rows or at K <= 1024. Otherwise the zero-workspace kernel is, slower
// wherever the few-rows kernel applies.
bool square_matmul_few_rows_suits(int64_t rows, int64_t k, bool transpose, bool workspace);

// The default path's kernel on sm_90 (sm_90a builds), for fp16/bf16 where the warpgroup
// kernel applies and the rows fill at least half of the GPU: an ordinary GEMM whose CTAs
// write their output tiles over x once every CTA of the same rows has read them, which they
// tell each other through one int counter per 128 rows in global memory. The number of
// counters it needs, or 0 where it does not apply (then square_matmul_handshake must not be
// called).
template <typename T>
int64_t square_matmul_handshake_counters(const T* x, const RowLayout& layout, const T* w,
                                         bool transpose);

// x <- x @ W (or x @ W^T) + bias by that kernel, arguments as square_matmul_zero_ws's;
// counters: square_matmul_handshake_counters's number of ints. counters_zero: they are all 0
// when the kernel starts (else they are zeroed on `stream` first). The kernel leaves them all
// 0 when it completes, so that counters kept for a stream need zeroing only once.
template <typename T>
cudaError_t square_matmul_handshake(T* x, const RowLayout& layout, const T* w, const T* bias,
                                   bool transpose, int* counters, bool counters_zero,
                                   cudaStream_t stream);

}  // namespace mti
