// When the extension is built without its CUDA kernels, calling an op on CUDA tensors raises an
// error that says how to rebuild, instead of the dispatcher's generic "no kernel" message.
#ifndef LEANDDP_WITH_CUDA
#include <torch/library.h>

namespace {

void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(
      false, op.schema().name(),
      ": leanddp was built without its CUDA kernels (CPU-only build). Reinstall it "
      "against a CUDA build of torch with nvcc available: "
      "LEANDDP_FORCE_CUDA=1 pip install --no-build-isolation --force-reinstall --no-deps .");
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CUDA, m) {
  for (const char* name :
       {"flatten_into", "unflatten_from", "adam_step_", "sgd_step_", "adam8bit_step_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  }
}
#endif
