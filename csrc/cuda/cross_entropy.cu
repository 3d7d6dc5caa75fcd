// CUDA host function of cross_entropy_: plan (every check that needs no target value, before
// any byte of logits is written), then the kernels of csrc/kernels/cross_entropy/, which check
// the target values on the device (no host synchronisation) before the row kernel writes.
// Extra memory: one int64 counter (the valid rows), and a contiguous copy of target only where
// target is not contiguous.
#include "common/plans.h"
#include "cuda/cuda_ops.h"
#include "cuda/dispatch.h"
#include "kernels/cross_entropy/cross_entropy.h"

namespace mti::cuda {

void cross_entropy_(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
                    int64_t reduction, double label_smoothing, const at::Tensor& losses) {
  const CrossEntropyPlan plan =
      plan_cross_entropy(logits, target, ignore_index, reduction, label_smoothing, losses);
  const c10::cuda::CUDAGuard guard(logits.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor valid_rows = at::empty({1}, logits.options().dtype(at::kLong));
  auto* counter = reinterpret_cast<unsigned long long*>(valid_rows.data_ptr<int64_t>());
  const int64_t* t = plan.target.const_data_ptr<int64_t>();
  if (logits.scalar_type() == at::kDouble) {
    C10_CUDA_CHECK(launch_cross_entropy(logits.data_ptr<double>(), plan.logits, t, plan.params,
                                        losses.data_ptr<double>(), counter, stream));
    return;
  }
  MTI_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy_", [&] {
    C10_CUDA_CHECK(launch_cross_entropy(device_ptr<scalar_t>(logits), plan.logits, t, plan.params,
                                        losses.data_ptr<float>(), counter, stream));
  });
}

}  // namespace mti::cuda
