// Kernels for calls no backend kernel receives. The optimizer ops take only tensor lists, so a
// call with every list empty carries no tensor for the dispatcher to pick a backend from: it
// lands here, is validated like any call, and does nothing. Tensors on a device without a
// leanddp kernel (e.g. MPS) land here too, and get an error that says so.
#include "checks.h"

#include <torch/library.h>

namespace leanddp::ops {
namespace {

void no_backend(const char* op, at::TensorList params) {
  TORCH_CHECK(params.empty(), op, ": no kernel for tensors on ", params[0].device(),
              "; leanddp supports CPU and CUDA");
}

void adam_step_fallback(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                        at::TensorList exp_avg_sq, at::TensorList param_copy, double lr,
                        double beta1, double beta2, double eps, double weight_decay, int64_t step,
                        bool, bool, std::optional<double> grad_scale, at::TensorList state_steps,
                        const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& amp_scale,
                        const std::optional<at::Tensor>& found_inf, at::OptionalIntArrayRef) {
  check_adam_args(params, grads, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps,
                  weight_decay, step, grad_scale, {lr_tensor, state_steps, amp_scale, found_inf});
  no_backend("leanddp::adam_step_", params);
}

void sgd_step_fallback(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                       at::TensorList param_copy, double lr, double momentum, double dampening,
                       bool nesterov, double weight_decay, bool, bool,
                       std::optional<double> grad_scale, const std::optional<at::Tensor>& lr_tensor,
                       const std::optional<at::Tensor>& amp_scale,
                       const std::optional<at::Tensor>& found_inf) {
  check_sgd_args(params, grads, momentum_buffer, param_copy, lr, momentum, dampening, nesterov,
                 weight_decay, grad_scale, {lr_tensor, {}, amp_scale, found_inf});
  no_backend("leanddp::sgd_step_", params);
}

void adam8bit_step_fallback(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                            at::TensorList exp_avg_sq, at::TensorList exp_avg_scale,
                            at::TensorList exp_avg_sq_scale, at::TensorList param_copy,
                            const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned,
                            double lr, double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool, std::optional<double> grad_scale,
                            const std::optional<at::Tensor>& found_inf) {
  check_adam8_args({params, grads, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_copy,
                    qmap_signed, qmap_unsigned},
                   lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf);
  no_backend("leanddp::adam8bit_step_", params);
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CompositeExplicitAutograd, m) {
  m.impl("adam_step_", &adam_step_fallback);
  m.impl("sgd_step_", &sgd_step_fallback);
  m.impl("adam8bit_step_", &adam8bit_step_fallback);
}

}  // namespace leanddp::ops
