// The kernels write x through raw pointers, beneath autograd. PyTorch's own in-place ops bump
// the version counter of what they write in their ADInplaceOrView kernels, so that backward
// refuses a saved tensor that was overwritten since. Ours return nothing, which PyTorch's
// generic ADInplaceOrView fallback does not handle (it bumps returned aliases only), so this
// kernel bumps every Tensor(a!) argument once the op has written it, in grad mode and under
// no_grad alike. An op that raises wrote nothing and bumps nothing.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <vector>

namespace {

void write_then_bump_versions(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                              torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& arg = (*stack)[first + i];
    // Inference tensors have no version counter to bump.
    if (schema.is_mutable({c10::SchemaArgType::input, i}) && arg.isTensor() &&
        arg.toTensor().defined() && !arg.toTensor().is_inference())
      written.push_back(arg.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(make_torch_inplace, ADInplaceOrView, m) {
  for (const char* op :
       {"square_matmul_", "softmax_", "layer_norm_", "rms_norm_", "softmax_backward",
        "norm_backward", "cross_entropy_", "rope_", "rope_backward", "silu_mul_backward_"})
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&write_then_bump_versions>());
}
