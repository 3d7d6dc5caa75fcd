// CUDA host side of square_matmul_: x[..., K] <- x @ W (or x @ W^T) + bias, over x.
//
// Every mode, fp16/bf16 with 1-64 rows where they suit it: the few-rows kernel of
// kernels/square_matmul.cu, which needs no memory at all (where the workspace holds the
// output, only where it is faster than cuBLAS plus the copy back below).
// Default: on sm_90 (sm_90a builds), for fp16/bf16 with rows enough to fill half of the GPU,
// the handshake kernel of kernels/square_matmul.cu, whose workspace is one int per 128
// rows, kept for the stream (handshake_counters) (H100, fp16/bf16, M >= 4096: 0.74-1.07x
// torch.matmul's speed at 269e76b, where cuBLAS plus the copy back below ran at
// 0.65-0.94x). Elsewhere cuBLAS through ATen, a chunk of rows at a time into a workspace of
// at most workspace_bytes (less the CUDA allocator's rounding), each chunk copied back over
// its rows on a side stream while the GEMM of the next chunk runs. With no room for one row,
// room for chunks of too few rows (chunks_lose_accuracy) or no workspace to be had, what
// workspace_bytes=0 runs: the few-rows kernel where it takes the shape, else the
// zero-workspace kernel of kernels/square_matmul.cu.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/square_matmul.h"

namespace mti::cuda {
namespace {

// Chunk sizing of the default path (measure on the GPU before changing; workspace_bytes =
// 2 * chunk bytes sweeps smaller chunks without a rebuild).
//
// kChunkTargetBytes, the output of one chunk: half the default workspace. Measured on an H100
// (bf16, M >= 4096), 8 MiB chunks made N = 1024/2048 up to 1.8x slower than torch.matmul
// (many small GEMMs, and the copies did not hide behind them); the old single-stream scheme
// with 64 MiB chunks was at ~1.5x.
constexpr int64_t kChunkTargetBytes = 32 << 20;
// kMinChunkRows: every chunk's GEMM reads all of W again. With r rows it does r flops per
// byte of a 2-byte W, so r >= 1024 stays well above the ridge point (about 300 flop/byte for
// bf16 on H100) where W does not fit in L2 (K = 8192: 128 MiB).
constexpr int64_t kMinChunkRows = 1024;


// The CUDA caching allocator's granularity: requests round up to kAllocRound bytes, and those
// of more than kAllocSmall come from blocks it may hand out up to kAllocSmall larger.
constexpr int64_t kAllocRound = 512, kAllocSmall = int64_t{1} << 20;

// The bytes of workspace to ask the CUDA caching allocator for so that what it counts as
// allocated stays within workspace_bytes: it rounds every request up to 512 bytes, and it hands
// out a cached free block of more than 1 MiB whole, uncut, when cutting would leave 1 MiB or
// less, so a request of over 1 MiB can cost up to 1 MiB more than asked (seen on an H100: a
// 3 MiB workspace took a 4 MiB block). Requests of at most 1 MiB come from blocks that are cut
// down to 512 bytes.
int64_t allocatable_bytes(int64_t workspace_bytes) {
  if (workspace_bytes <= kAllocSmall) return workspace_bytes / kAllocRound * kAllocRound;
  return std::max(kAllocSmall, (workspace_bytes - kAllocSmall) / kAllocRound * kAllocRound);
}

// The least workspace_bytes whose allocatable_bytes holds `bytes`.
int64_t workspace_holding(int64_t bytes) {
  const int64_t rounded = (bytes + kAllocRound - 1) / kAllocRound * kAllocRound;
  return rounded <= kAllocSmall ? rounded : rounded + kAllocSmall;
}

// Copies each chunk back on a side stream, so that the copy of chunk i (memory-bound) runs
// while the GEMM of chunk i+1 (compute-bound) runs on the caller's stream, the chunks
// alternating between two buffers of at most half of workspace_bytes each. Events order the
// streams: GEMM i done -> copy i may start; copy i done -> GEMM i+2, which reuses its
// buffer, may start.
class SideStreamCopies final : public ChunkPipeline {
 public:
  explicit SideStreamCopies(c10::cuda::CUDAStream caller) : caller_(caller) {}

  ChunkSchedule schedule(int64_t rows, int64_t row_bytes,
                         int64_t workspace_bytes) const override {
    const int64_t target = std::max(kMinChunkRows, kChunkTargetBytes / row_bytes);
    const int64_t fit_one = workspace_bytes / row_bytes;
    if (rows <= std::min(target, fit_one)) return {rows, 1};  // one chunk, nothing to overlap
    const int64_t fit_each = workspace_bytes / (kBuffers * row_bytes);
    if (fit_each < 1) return {fit_one, 1};  // room for one row but not two: chunks in turn
    return {std::min(target, fit_each), kBuffers};
  }

  void before_gemm(int buffer) override {
    // The copy that last read this buffer must be done (a no-op on the first use of each
    // buffer: block() does nothing for an event never recorded).
    copied_[buffer].block(caller_);
  }

  void copy_back(const at::Tensor& dst, const at::Tensor& chunk, int buffer) override {
    if (!side_) side_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                                     caller_.device_index());
    computed_.record(caller_);  // after the GEMM that wrote `chunk` and all work before it
    computed_.block(*side_);
    {
      const c10::cuda::CUDAStreamGuard on_side(*side_);
      dst.copy_(chunk);
    }
    copied_[buffer].record(*side_);
  }

  // The caller's stream waits for every copy. Without this, work the caller queues next
  // could read x before its rows are written, and the workspace, freed on the caller's
  // stream as soon as square_matmul_with_workspace returns, could be handed by the caching
  // allocator to the next allocation on that stream (it tracks only the stream a block was
  // allocated on) and overwritten while a copy still reads it. Waiting here, rather than
  // ws.record_stream(side), also keeps the block reusable at once, so the allocator's peak
  // does not grow past the workspace.
  void join() override {
    if (!side_) return;
    joined_.record(*side_);
    joined_.block(caller_);
  }

 private:
  static constexpr int kBuffers = 2;
  c10::cuda::CUDAStream caller_;
  std::optional<c10::cuda::CUDAStream> side_;  // taken from the pool at the first copy
  c10::cuda::CUDAEvent computed_, joined_;
  std::array<c10::cuda::CUDAEvent, kBuffers> copied_;
};

// The handshake kernel's counters, kept for each stream that runs it: the kernel leaves every
// counter it used at 0 again, and launches on one stream run one after another, so a stream's
// counters are zeroed once (when allocated or grown) instead of by a memset before every launch,
// which cost 1.0-1.6 us per call (H100, bf16, one build, in turns with torch.matmul: M = 4096,
// K = 1024 21.2 -> 20.1 us, K = 4096 192.1 -> 191.1; M = 1024, K = 4096 51.8 -> 50.8). They
// come from the caching allocator and stay allocated: 4 bytes per 128 rows of the most rows
// the stream has multiplied. A stream being captured into a CUDA graph gets fresh counters
// instead (not zero: square_matmul_handshake zeroes them on the stream), which the graph then
// owns, since its replays may run on any stream; so does any stream past the first
// kMaxStreams. Throws c10::OutOfMemoryError as at::empty does.
struct HandshakeCounters {
  at::Tensor ints;
  bool zero;  // all 0 already (kept for the stream)
};
HandshakeCounters handshake_counters(int64_t count, const c10::cuda::CUDAStream& stream) {
  constexpr size_t kMaxStreams = 64;
  const auto options = at::TensorOptions().dtype(at::kInt).device(stream.device());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone) return {at::empty({count}, options), false};
  static std::mutex mutex;
  // Never destroyed: their memory is the allocator's until the process ends.
  static auto* const kept = new std::map<std::pair<c10::DeviceIndex, c10::StreamId>, at::Tensor>;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(stream.device_index(), stream.id());
  const auto it = kept->find(key);
  if (it == kept->end() && kept->size() >= kMaxStreams) return {at::empty({count}, options), false};
  if (it != kept->end() && it->second.numel() >= count) return {it->second, true};
  // On `stream` (the current one), like the kernel; the counters it replaces may still be in
  // use by a launch queued there, which the allocator's stream order keeps safe.
  return {(*kept)[key] = at::zeros({count}, options), true};
}

// x <- x @ Wv (+ bias) by the few-rows kernel (up to 64 16-bit rows, no workspace); false,
// with nothing written, where it declines the shape or the device.
template <typename scalar_t>
bool run_few_rows(const at::Tensor& x, const MatmulPlan& plan, cudaStream_t stream) {
  using T = typename DeviceType<scalar_t>::type;
  const cudaError_t err = square_matmul_few_rows<T>(
      device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight),
      plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr, plan.transpose, stream);
  if (err == cudaErrorNotSupported || err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

// x <- x @ Wv (+ bias) with no memory of its own, as workspace_bytes=0 runs it: the few-rows
// kernel where it takes the shape (unless `few_rows_tried` already), else the zero-workspace
// kernel. Raises before writing anything when K is beyond the latter's shared memory; `why`
// says why no workspace is used.
template <typename scalar_t>
void run_without_workspace(const at::Tensor& x, const MatmulPlan& plan, cudaStream_t stream,
                           bool few_rows_tried, const char* why) {
  using T = typename DeviceType<scalar_t>::type;
  if (!few_rows_tried && run_few_rows<scalar_t>(x, plan, stream)) return;
  int64_t max_k = 0;
  C10_CUDA_CHECK(square_matmul_zero_ws_max_k<T>(&max_k));
  TORCH_CHECK(plan.k <= max_k, "square_matmul_: K=", text(plan.k),
              " is too large for the zero-workspace kernel (max ", text(max_k), " for ",
              x.scalar_type(), " on this GPU), which is used because ", why,
              "; allow a workspace of at least ", text(workspace_holding(plan.k * x.element_size())),
              " bytes (one row, in the CUDA allocator's granularity)");
  C10_CUDA_CHECK(square_matmul_zero_ws<T>(
      device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight),
      plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr, plan.transpose, stream));
}

}  // namespace

void square_matmul_(const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, bool transpose,
                    int64_t workspace_bytes) {
  const MatmulPlan plan = plan_square_matmul(x, weight, bias, transpose, workspace_bytes);
  if (plan.x.rows == 0) return;  // also K == 0
  const c10::cuda::CUDAGuard guard(x.device());
  const c10::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream();
  const cudaStream_t stream = current;
  // The dispatch also refuses float64 (which the plan accepts for the CPU's gradcheck) on
  // every path, before anything is written.
  MTI_DISPATCH_FLOATING(x.scalar_type(), "square_matmul_", [&] {
    using T = typename DeviceType<scalar_t>::type;
    const int64_t budget = allocatable_bytes(workspace_bytes);
    // Up to 64 rows (decoding): the few-rows kernel, which needs no memory, unless the
    // workspace holds the output and cuBLAS plus the copy back is faster (if that workspace
    // then cannot be allocated, run_without_workspace tries the few-rows kernel after all).
    const bool few_rows_tried = square_matmul_few_rows_suits(
        plan.x.rows, plan.k, plan.transpose, budget >= plan.x.rows * plan.k * x.element_size());
    if (few_rows_tried && run_few_rows<scalar_t>(x, plan, stream)) return;
    const int64_t counters = square_matmul_handshake_counters<T>(
        device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight), plan.transpose);
    // The counters come from the caching allocator like any workspace, so they count
    // against the limit (and a workspace of 0 keeps the zero-workspace kernel), kept or not.
    if (counters > 0 && counters * static_cast<int64_t>(sizeof(int)) <= budget) {
      HandshakeCounters counter_ints;
      try {
        counter_ints = handshake_counters(counters, current);
      } catch (const c10::OutOfMemoryError&) {
        run_without_workspace<scalar_t>(x, plan, stream, few_rows_tried,
                                        "the workspace could not be allocated");
        return;
      }
      const cudaError_t err = square_matmul_handshake<T>(
          device_ptr<scalar_t>(x), plan.x, device_ptr<scalar_t>(plan.weight),
          plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr, plan.transpose,
          counter_ints.ints.data_ptr<int>(), counter_ints.zero, stream);
      // Its grid must be resident at once; where fewer SMs are ours than the device has
      // (MPS, green contexts), the launch is refused, nothing but the counters' zeroing has
      // run (they stay 0), and cuBLAS takes over.
      if (err != cudaErrorCooperativeLaunchTooLarge) {
        C10_CUDA_CHECK(err);
        return;
      }
      (void)cudaGetLastError();
    }
    SideStreamCopies pipeline(current);
    // The zero-workspace kernel measured 0.8x torch.matmul's fp32 error there (H100).
    if (chunks_lose_accuracy(x, plan, budget, pipeline)) {
      int64_t max_k = 0;
      C10_CUDA_CHECK(square_matmul_zero_ws_max_k<T>(&max_k));
      if (plan.k <= max_k) {
        run_without_workspace<scalar_t>(x, plan, stream, few_rows_tried,
                                        "chunks of so few rows lose accuracy");
        return;
      }
    }
    if (const char* why = square_matmul_with_workspace(x, plan, budget, pipeline))
      run_without_workspace<scalar_t>(x, plan, stream, few_rows_tried, why);
  });
}

}  // namespace mti::cuda
