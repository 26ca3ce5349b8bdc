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
  // One Adam (decoupled_weight_decay=False) or AdamW step. params: float32 (grads
  // float32/bfloat16/float16; param_copy, if not empty, receives a bf16/fp16 copy of the update)
  // or bfloat16/float16 (grads and state in the params' dtype, no param_copy), stepped in float32
  // math. Device scalars, as torch's fused optimizers take them: lr_tensor (one element,
  // float32/float64) replaces lr; state_steps (one float32 scalar per param, the 1-based count of
  // this update; empty: none) replace step; grads are divided by amp_scale (GradScaler's
  // scale); a nonzero found_inf makes the call do nothing. tail_from (CPU; one per param): where
  // torch's tail arithmetic starts in it, for a param that is a piece of a larger tensor
  // (default: the param's own last numel % (32 bytes / element size) elements).
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg, "
      "Tensor(c!)[] exp_avg_sq, Tensor(d!)[] param_copy, *, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, int step, bool decoupled_weight_decay, bool maximize, "
      "float? grad_scale, Tensor[] state_steps, Tensor? lr_tensor=None, "
      "Tensor? amp_scale=None, Tensor? found_inf=None, int[]? tail_from=None) -> ()");
  // One SGD step; momentum_buffer is empty when momentum == 0. Dtypes and device scalars as
  // for adam_step_.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffer, "
      "Tensor(c!)[] param_copy, *, float lr, float momentum, float dampening, bool nesterov, "
      "float weight_decay, bool maximize, bool first_step, float? grad_scale, "
      "Tensor? lr_tensor=None, Tensor? amp_scale=None, Tensor? found_inf=None) -> ()");
  // One step of torchao's block-wise 8-bit Adam (decoupled_weight_decay=False) or AdamW
  // (optim8_math.h). exp_avg[i] and exp_avg_sq[i] are uint8 codes, one per element of the
  // contiguous params[i], with one float32 scale per block of numel / scale.numel() elements in
  // exp_avg_scale[i] / exp_avg_sq_scale[i], dequantized through qmap_signed / qmap_unsigned
  // (torchao's 256-entry maps, on the params' device); or plain state in the params' dtype, with
  // empty scale entries (torchao's state of small parameters). params, grads and param_copy as
  // for adam_step_; step is the 1-based count of this update; grad_scale multiplies the
  // gradients; a nonzero found_inf makes the call do nothing.
  m.def(
      "adam8bit_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avg, "
      "Tensor(c!)[] exp_avg_sq, Tensor(d!)[] exp_avg_scale, Tensor(e!)[] exp_avg_sq_scale, "
      "Tensor(f!)[] param_copy, Tensor qmap_signed, Tensor qmap_unsigned, *, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, int step, "
      "bool decoupled_weight_decay, float? grad_scale, Tensor? found_inf=None) -> ()");
}
