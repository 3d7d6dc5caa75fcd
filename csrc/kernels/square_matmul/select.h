// Which way square_matmul_ (x <- x @ W (+ bias), written over x) takes for a call, and the
// launch of its own kernels. No torch here: the host side (csrc/cuda/square_matmul.cu) asks
// select_square_matmul for a plan, runs cuBLAS's GEMM where the plan says so and its own
// kernels through run_square_matmul, and asks again, saying what failed, where what it ran
// could not get its memory or its cooperative launch was refused.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/row_layout.h"

namespace mti::square_matmul {

enum class Kernel {
  kCublas,       // the host's GEMM in chunks of rows through a workspace, copied back over x
  kFewRows,      // few_rows.cu: fp16/bf16, 1 to kFewRowsMax rows; no memory
  kHandshake,    // handshake.cu: fp16/bf16 on sm_90a; an int of workspace per 128 rows
  kWgmmaStream,  // wgmma_stream.cu   } the zero-workspace kernels: no memory; K bound by
  kStream,       // stream.cu         } shared memory
  kMma,          // mma.cu            }
  kFma,          // fma.cu            }
  kTooLarge,     // none can run: K is past the zero-workspace kernels' shared memory
};

// The few-rows kernel's launch: blocks of na 16-column tiles over mt tiles of 8 rows.
struct FewRowsConfig {
  int na = 0;
  int mt = 0;
  int warps = 0;  // per block; 0: its blocks do not all fit on the GPU at once
};

// A streaming kernel's launch: clusters of `cluster` blocks share a row block, each block
// computing tpc column tiles; the index of its tile shape in tuning.h's list.
struct StreamConfig {
  int tile = 0;
  int tpc = 0;
  int cluster = 0;
  int64_t cost = INT64_MAX;  // in the cost model's units; INT64_MAX: no launch fits
};

// The handshake kernel's launch: `grid` CTAs, all resident at once, in clusters of `cluster`
// that share W tiles, and `counters` ints of workspace (0: the kernel does not apply).
struct HandshakeConfig {
  int cluster = 1;
  int grid = 0;
  int64_t counters = 0;
};

struct Plan {
  Kernel kernel = Kernel::kCublas;
  // kFewRows: tried in order, the second (where it has warps) if the first's cooperative
  // launch is refused.
  FewRowsConfig few_rows[2];
  HandshakeConfig handshake;
  StreamConfig stream;  // kWgmmaStream, kStream
  int tile = 0;         // kMma, kFma: the index of the tile shape in tuning.h's list
  int64_t max_k = 0;    // kTooLarge: the largest K the zero-workspace kernels take
};

// What the host offers a call, and what it has found since its last plan.
struct Offer {
  int64_t workspace_bytes = 0;     // what it may allocate (0: nothing)
  bool chunks_accurate = true;     // cuBLAS's chunks of rows would be as accurate as one GEMM
  bool few_rows_refused = false;   // the few-rows kernel's launch was refused
  bool handshake_refused = false;  // the handshake kernel's launch was refused
  bool no_workspace = false;       // the workspace could not be had
};

// The plan for x <- x @ W (or x @ W^T) + bias on the current device. x: layout.rows rows of
// K = layout.n elements, neighbours in a row adjacent (col_stride 1), row r starting at
// x + layout.row.offset(r); rows must not overlap each other, W or bias; rows >= 1, K >= 1.
// w: (K, K) contiguous. T is float, __half or __nv_bfloat16. Returns an error only where the
// device cannot be queried.
template <typename T>
cudaError_t select_square_matmul(const T* x, const RowLayout& layout, const T* w, bool transpose,
                                 const Offer& offer, Plan* plan);

// Runs `plan`'s kernel (not kCublas, kTooLarge) on `stream`; bias: K elements or nullptr.
// kHandshake: counters holds plan.handshake.counters ints, all 0 where counters_zero (else
// they are zeroed on the stream first); the kernel leaves them 0. Accumulation is fp32 (full
// fp32 FMA for float). kFewRows and kHandshake return cudaErrorCooperativeLaunchTooLarge, having
// written nothing to x, where their cooperative launch is refused (under MPS, say); otherwise
// the launches' error.
template <typename T>
cudaError_t run_square_matmul(const Plan& plan, T* x, const RowLayout& layout, const T* w,
                              const T* bias, bool transpose, int* counters, bool counters_zero,
                              cudaStream_t stream);

}  // namespace mti::square_matmul
