// The one place that decides how square_matmul_ runs a call (select.h), and the launch of the
// kernel it picks. In order of preference:
//  1. the few-rows kernel (no memory), where the call has few rows and, if the workspace
//     holds the output, its tuning table puts it ahead of cuBLAS plus a copy back;
//  2. the handshake kernel (an int per 128 rows of workspace), where it applies;
//  3. cuBLAS's GEMM in chunks of rows through the workspace, each copied back over its rows
//     (the host's), unless its chunks would have so few rows that they lose accuracy and a
//     zero-workspace kernel takes K;
//  4. without workspace: the few-rows kernel (where it did not go first), else the
//     zero-workspace kernels: the warpgroup streaming kernel, the streaming kernel, the
//     mma.sync staging kernel, the FMA staging kernel, the first that applies and fits.
// What failed at run time (Offer) takes a way out of the running.
#include "kernels/square_matmul/select.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/launch.h"
#include "kernels/square_matmul/tuning.h"
#include "kernels/square_matmul/wgmma_tile.cuh"

namespace mti::square_matmul {
namespace {

template <typename T>
bool use_tensor_cores(const DeviceInfo& d) {
  return sizeof(T) == 2 && (d.cc >= 80 || (d.cc >= 75 && std::is_same_v<T, __half>));
}

// Whether the warpgroup kernels apply to a: fp16/bf16 on sm_90 with this build's sm_90a code,
// x's rows evenly spaced, 16-byte chunks of x and W.
template <typename T>
bool wgmma_applies(const Args<T>& a, const DeviceInfo& d) {
  return sizeof(T) == 2 && use_tensor_cores<T>(d) && d.cc == 90 && a.x_vec && a.w_vec &&
         has_wgmma() && tma_ready(a);
}

// The current device's DeviceInfo, queried at the first need (none for a call that only
// cuBLAS runs).
class Device {
 public:
  cudaError_t get(const DeviceInfo** info) {
    if (!asked_) {
      err_ = current_device(&info_);
      asked_ = true;
    }
    *info = &info_;
    return err_;
  }

 private:
  DeviceInfo info_;
  cudaError_t err_ = cudaSuccess;
  bool asked_ = false;
};

// Whether the few-rows kernel takes the shape: fp16/bf16, 1 to kFewRowsMax rows, K in its
// whole steps (16 for x @ W, 32 for x @ W^T).
template <typename T>
bool few_rows_shape(const RowLayout& layout, bool transpose) {
  return sizeof(T) == 2 && layout.rows >= 1 && layout.rows <= kFewRowsMax && layout.n > 0 &&
         layout.n % (transpose ? 32 : 16) == 0;
}

// The few-rows kernel's plan where it applies on the device (tensor cores, cooperative
// launches, 16-byte chunks of x and W) and its blocks fit at once; false, the plan as it was,
// elsewhere.
template <typename T>
bool plan_few_rows(const Args<T>& a, bool transpose, const DeviceInfo& d, Plan* plan) {
  if constexpr (sizeof(T) != 2) {
    return false;
  } else {
    if (!use_tensor_cores<T>(d) || !d.coop || !a.x_vec || !a.w_vec) return false;
    FewRowsConfig configs[2];
    few_rows_configs<T>(a, transpose, d, configs);
    if (configs[0].warps == 0) return false;
    plan->kernel = Kernel::kFewRows;
    plan->few_rows[0] = configs[0];
    plan->few_rows[1] = configs[1];
    return true;
  }
}

// The largest K the zero-workspace kernels take on the device.
template <typename T>
int64_t zero_workspace_max_k(const DeviceInfo& d) {
  return use_tensor_cores<T>(d) ? staging_max_k<MmaStaging>(sizeof(T), d.smem_optin)
                                : staging_max_k<FmaStaging>(sizeof(T), d.smem_optin);
}

// The zero-workspace kernels' plan: on sm_90 for fp16/bf16 in 16-byte chunks the streaming
// kernels where a launch fits, else the staging kernel (mma.sync where T's tensor cores are
// there, else FMA).
template <typename T>
void plan_zero_workspace(const Args<T>& a, bool transpose, const DeviceInfo& d, Plan* plan) {
  plan->max_k = zero_workspace_max_k<T>(d);
  if (a.k > plan->max_k) {
    plan->kernel = Kernel::kTooLarge;
    return;
  }
  if constexpr (sizeof(T) == 2) {
    if (use_tensor_cores<T>(d)) {
      if (d.cc >= 90 && a.x_vec && a.w_vec) {
        if (wgmma_applies(a, d)) {
          plan->stream = stream_config<WgmmaStream>(a, transpose, d);
          plan->kernel = Kernel::kWgmmaStream;
          if (plan->stream.cost != INT64_MAX) return;
        }
        plan->stream = stream_config<MmaStream>(a, transpose, d);
        plan->kernel = Kernel::kStream;
        if (plan->stream.cost != INT64_MAX) return;
      }
      plan->tile = staging_tile<MmaStaging>(a, transpose, d);
      plan->kernel = Kernel::kMma;
      return;
    }
  }
  plan->tile = staging_tile<FmaStaging>(a, transpose, d);
  plan->kernel = Kernel::kFma;
}

}  // namespace

template <typename T>
cudaError_t select_square_matmul(const T* x, const RowLayout& layout, const T* w, bool transpose,
                                 const Offer& offer, Plan* plan) {
  *plan = Plan{};
  const Args<T> a = make_args<T>(const_cast<T*>(x), layout, w, nullptr, /*mma=*/true);
  Device device;
  const DeviceInfo* d = nullptr;
  cudaError_t err = cudaSuccess;

  // 1. The few-rows kernel, unless the workspace holds the output and cuBLAS is the faster.
  const bool few_rows = !offer.few_rows_refused && few_rows_shape<T>(layout, transpose);
  bool few_rows_first = false;
  if (few_rows) {
    if ((err = device.get(&d)) != cudaSuccess) return err;
    const bool output_fits =
        offer.workspace_bytes >= layout.rows * layout.n * static_cast<int64_t>(sizeof(T));
    few_rows_first =
        !output_fits || layout.rows <= tuned(transpose ? kFewRowsFirstXwt : kFewRowsFirstXw,
                                             tuning_key(*d, sizeof(T), layout.n));
    if (few_rows_first && plan_few_rows(a, transpose, *d, plan)) return cudaSuccess;
  }

  // 2. The handshake kernel, where its counters fit in the workspace. A device that cannot be
  // queried here leaves it out.
  if (sizeof(T) == 2 && !offer.no_workspace && !offer.handshake_refused &&
      device.get(&d) == cudaSuccess && wgmma_applies(a, *d) && d->coop) {
    const HandshakeConfig h = handshake_config<T>(a, transpose, *d);
    if (h.counters > 0 && h.counters * static_cast<int64_t>(sizeof(int)) <= offer.workspace_bytes) {
      plan->kernel = Kernel::kHandshake;
      plan->handshake = h;
      return cudaSuccess;
    }
  }

  // 3. cuBLAS through the workspace. Chunks of too few rows are less accurate than the
  // zero-workspace kernels (chunks_lose_accuracy), which take over where they take K.
  if (!offer.no_workspace) {
    if (offer.chunks_accurate) return cudaSuccess;  // plan->kernel is kCublas
    if ((err = device.get(&d)) != cudaSuccess) return err;
    if (layout.n > zero_workspace_max_k<T>(*d)) return cudaSuccess;
  }

  // 4. No workspace.
  if ((err = device.get(&d)) != cudaSuccess) return err;
  if (few_rows && !few_rows_first && plan_few_rows(a, transpose, *d, plan)) return cudaSuccess;
  plan_zero_workspace(a, transpose, *d, plan);
  return cudaSuccess;
}

template <typename T>
cudaError_t run_square_matmul(const Plan& plan, T* x, const RowLayout& layout, const T* w,
                              const T* bias, bool transpose, int* counters, bool counters_zero,
                              cudaStream_t stream) {
  const Args<T> a = make_args(x, layout, w, bias, /*mma=*/plan.kernel != Kernel::kFma);
  if (plan.kernel == Kernel::kMma || plan.kernel == Kernel::kFma) {
    DeviceInfo d;
    const cudaError_t err = current_device(&d);
    if (err != cudaSuccess) return err;
    if (plan.kernel == Kernel::kFma)
      return launch_staging<FmaStaging>(a, transpose, plan.tile, d, stream);
    if constexpr (sizeof(T) == 2)
      return launch_staging<MmaStaging>(a, transpose, plan.tile, d, stream);
  }
  if constexpr (sizeof(T) == 2) {
    switch (plan.kernel) {
      case Kernel::kFewRows: {
        cudaError_t err = launch_few_rows(a, transpose, plan.few_rows[0], stream);
        if (err == cudaErrorCooperativeLaunchTooLarge && plan.few_rows[1].warps > 0) {
          cudaGetLastError();  // the refused launch's error, not the next one's
          err = launch_few_rows(a, transpose, plan.few_rows[1], stream);
        }
        return err;
      }
      case Kernel::kHandshake:
        return launch_handshake(a, transpose, plan.handshake, counters, counters_zero, stream);
      case Kernel::kWgmmaStream:
        return launch_stream<WgmmaStream>(a, transpose, plan.stream, stream);
      case Kernel::kStream:
        return launch_stream<MmaStream>(a, transpose, plan.stream, stream);
      default:
        break;
    }
  }
  return cudaErrorInvalidValue;  // not a kernel of ours (kCublas, kTooLarge)
}

#define MTI_INSTANTIATE(T)                                                                         \
  template cudaError_t select_square_matmul<T>(const T*, const RowLayout&, const T*, bool,         \
                                               const Offer&, Plan*);                               \
  template cudaError_t run_square_matmul<T>(const Plan&, T*, const RowLayout&, const T*, const T*, \
                                            bool, int*, bool, cudaStream_t);
MTI_INSTANTIATE(float)
MTI_INSTANTIATE(__half)
MTI_INSTANTIATE(__nv_bfloat16)
#undef MTI_INSTANTIATE

}  // namespace mti::square_matmul
