// CUDA host side of square_matmul_: x[..., K] <- x @ W (or x @ W^T) + bias, over x.
//
// kernels/square_matmul/select.h decides how a call runs: the few-rows kernel, the handshake
// kernel, cuBLAS in chunks of rows, or a zero-workspace kernel (float64: cuBLAS in chunks or
// kernels/square_matmul/f64.h, chosen here). This file follows its plan:
// it runs cuBLAS through ATen, a chunk of rows at a time into a workspace of at most
// workspace_bytes (less the CUDA allocator's rounding), each chunk copied back over its rows
// on a side stream while the GEMM of the next chunk runs; it keeps the handshake kernel's
// counters for each stream; and where the workspace cannot be had or a cooperative launch is
// refused, it says so and follows the next plan.
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

#include "common/checks.h"
#include "common/chunked_gemm.h"
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/common.cuh"
#include "kernels/square_matmul/f64.h"
#include "kernels/square_matmul/select.h"
#include "kernels/square_matmul/tuning.h"

namespace mti::cuda {
namespace {

namespace sm = mti::square_matmul;

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
// buffer, may start. Chunks aim at chunk_bytes of output and at least min_rows rows
// (tuning.h).
class SideStreamCopies final : public ChunkPipeline {
 public:
  SideStreamCopies(c10::cuda::CUDAStream caller, int64_t chunk_bytes, int64_t min_rows)
      : caller_(caller), chunk_bytes_(chunk_bytes), min_rows_(min_rows) {}

  ChunkSchedule schedule(int64_t rows, int64_t row_bytes, int64_t workspace_bytes) const override {
    const int64_t target = std::max(min_rows_, chunk_bytes_ / row_bytes);
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
    if (!side_)
      side_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, caller_.device_index());
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
  int64_t chunk_bytes_, min_rows_;
  std::optional<c10::cuda::CUDAStream> side_;  // taken from the pool at the first copy
  c10::cuda::CUDAEvent computed_, joined_;
  std::array<c10::cuda::CUDAEvent, kBuffers> copied_;
};

// The handshake kernel's counters, kept for each stream that runs it: the kernel leaves every
// counter it used at 0 again, and launches on one stream run one after another, so a stream's
// counters are zeroed once (when allocated or grown) instead of by a memset before every
// launch, which costs about a microsecond per call. They come from the caching allocator and
// stay allocated: 4 bytes per 128 rows of the most rows the stream has multiplied. A stream
// being captured into a CUDA graph gets fresh counters instead (not zero: the kernel's launch
// zeroes them on the stream first), which the graph then owns, since its replays may run on
// any stream; so does any stream past the first kMaxStreams. Throws c10::OutOfMemoryError as
// at::empty does.
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

// Unless `fits`, raises the error of a K past the zero-workspace kernel's limit max_k, the
// kernel being used because `why`.
void check_fits_without_workspace(bool fits, const at::Tensor& x, int64_t k, int64_t max_k,
                                  const char* why) {
  TORCH_CHECK(fits, "square_matmul_: K=", text(k),
              " is too large for the zero-workspace kernel (max ", text(max_k), " for ",
              x.scalar_type(), " on this GPU), which is used because ", why,
              "; allow a workspace of at least ", text(workspace_holding(k * x.element_size())),
              " bytes (one row, in the CUDA allocator's granularity)");
}

// float64: cuBLAS's DGEMM in chunks through the workspace where one can be had, else (or where
// cuBLAS's chunks would be less accurate) the kernel of kernels/square_matmul/f64.cu, which
// takes K up to the row of doubles that fits in a CTA's shared memory and refuses larger K
// before anything is written.
void square_matmul_f64(const at::Tensor& x, const MatmulPlan& plan, int64_t workspace_bytes,
                       c10::cuda::CUDAStream current) {
  DeviceInfo device;
  C10_CUDA_CHECK(current_device(&device));
  const int64_t max_k = sm::f64_max_k(device.smem_optin);
  const TuningKey key = tuning_key(device, sizeof(double), plan.k);
  SideStreamCopies pipeline(current, tuned(sm::kChunkBytes, key), tuned(sm::kChunkMinRows, key));
  const int64_t bytes = allocatable_bytes(workspace_bytes);
  const char* why = "cuBLAS's chunks of so few rows would be less accurate";
  if (plan.k > max_k || !chunks_lose_accuracy(x, plan, bytes, pipeline)) {
    why = square_matmul_with_workspace(x, plan, bytes, pipeline);
    if (why == nullptr) return;
  }
  check_fits_without_workspace(plan.k <= max_k, x, plan.k, max_k, why);
  C10_CUDA_CHECK(sm::launch_square_matmul_f64(
      x.data_ptr<double>(), plan.x, plan.weight.data_ptr<double>(),
      plan.bias ? plan.bias->data_ptr<double>() : nullptr, plan.transpose, current.stream()));
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
  if (x.scalar_type() == at::kDouble) return square_matmul_f64(x, plan, workspace_bytes, current);
  MTI_DISPATCH_FLOATING(x.scalar_type(), "square_matmul_", [&] {
    using T = typename DeviceType<scalar_t>::type;
    T* const x_data = device_ptr<scalar_t>(x);
    const T* const w = device_ptr<scalar_t>(plan.weight);
    const T* const b = plan.bias ? device_ptr<scalar_t>(*plan.bias) : nullptr;
    DeviceInfo device;
    C10_CUDA_CHECK(current_device(&device));
    const TuningKey key = tuning_key(device, sizeof(T), plan.k);
    SideStreamCopies pipeline(current, tuned(sm::kChunkBytes, key), tuned(sm::kChunkMinRows, key));
    sm::Offer offer;
    offer.workspace_bytes = allocatable_bytes(workspace_bytes);
    offer.chunks_accurate = !chunks_lose_accuracy(x, plan, offer.workspace_bytes, pipeline);
    const char* why = "";  // why no workspace is used, once offer.no_workspace is set
    while (true) {
      sm::Plan p;
      C10_CUDA_CHECK(sm::select_square_matmul<T>(x_data, plan.x, w, plan.transpose, offer, &p));
      int* counters = nullptr;
      bool counters_zero = false;
      HandshakeCounters counter_ints;
      if (p.kernel == sm::Kernel::kCublas) {
        why = square_matmul_with_workspace(x, plan, offer.workspace_bytes, pipeline);
        if (why == nullptr) return;
        offer.no_workspace = true;
        continue;
      }
      // Comes only once no workspace is to be had: the zero-workspace kernels could not take
      // K otherwise.
      check_fits_without_workspace(p.kernel != sm::Kernel::kTooLarge, x, plan.k, p.max_k, why);
      if (p.kernel == sm::Kernel::kHandshake) {
        // The counters come from the caching allocator like any workspace, so they count
        // against the limit (the plan says they fit), kept or not.
        try {
          counter_ints = handshake_counters(p.handshake.counters, current);
        } catch (const c10::OutOfMemoryError&) {
          why = "the workspace could not be allocated";
          offer.no_workspace = true;
          continue;
        }
        counters = counter_ints.ints.data_ptr<int>();
        counters_zero = counter_ints.zero;
      }
      const cudaError_t err = sm::run_square_matmul<T>(p, x_data, plan.x, w, b, plan.transpose,
                                                       counters, counters_zero, stream);
      // The few-rows and handshake kernels' grids must be resident at once; where fewer SMs
      // are ours than the device has (MPS, green contexts), their launch is refused, nothing
      // but the counters' zeroing has run (they stay 0), and the next plan runs.
      if (err == cudaErrorCooperativeLaunchTooLarge &&
          (p.kernel == sm::Kernel::kFewRows || p.kernel == sm::Kernel::kHandshake)) {
        (void)cudaGetLastError();
        (p.kernel == sm::Kernel::kFewRows ? offer.few_rows_refused : offer.handshake_refused) =
            true;
        continue;
      }
      C10_CUDA_CHECK(err);
      return;
    }
  });
}

}  // namespace mti::cuda
