// The schemas of leanddp's custom ops: the one place that defines them. Each backend registers
// its kernels in its own file (flatten_cpu.cpp, optim_cpu.cpp, cuda/*.cu); python/leanddp/ops.py
// holds the typed Python wrappers and the fake (meta) implementations.
#include <torch/library.h>

TORCH_LIBRARY(leanddp, m) {
  // Copies `tensors` (one dtype, any shapes and strides) into consecutive slices of the 1-D
  // `out`, times `scale` if given.
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out, float? scale=None) -> ()");
  // The inverse: consecutive slices of the 1-D `flat` into `tensors`, in place.
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] tensors, float? scale=None) -> ()");
  // One Adam (decoupled_weight_decay=False) or AdamW step on float32 params and state; grads
  // float32/bfloat16/float16; param_copy, if not empty, receives a bf16/fp16 copy of the update.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg, "
      "Tensor(c!)[] exp_avg_sq, Tensor(d!)[] param_copy, *, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, int step, bool decoupled_weight_decay, bool maximize, "
      "float? grad_scale) -> ()");
  // One SGD step; momentum_buffer is empty when momentum == 0.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffer, "
      "Tensor(c!)[] param_copy, *, float lr, float momentum, float dampening, bool nesterov, "
      "float weight_decay, bool maximize, bool first_step, float? grad_scale) -> ()");
}
