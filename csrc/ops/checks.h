// Argument validation shared by every backend of leanddp's ops.
//
// Each function runs before an op writes anything, and throws a c10::Error subclass (ValueError
// or TypeError in Python) whose message names the op, the argument and the list index at fault.
// The CPU and CUDA kernels call the same checks, so both backends accept and reject the same
// inputs.
#pragma once

#include "optim8_math.h"
#include "optim_math.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace leanddp::ops {

// flatten_into / unflatten_from.
//
// `tensors` are the per-tensor side, `flat` the 1-D buffer; `tensors_written` says which side is
// written (unflatten writes `tensors`, flatten writes `flat`). Checks: `flat` is 1-D and
// contiguous; every tensor has flat's dtype and device; their total numel fits in `flat`; `scale`
// is only given for floating dtypes; no written memory overlaps memory that is read, except a
// tensor that *is* its own slice of `flat` (a bucket view: dense and non-overlapping in any
// layout, its lowest element at its offset; see is_flat_slice), which is allowed. Returns the
// exclusive prefix sums of the numels (the flat offset of each tensor), plus the total at the end.
std::vector<int64_t> check_flat_args(const char* op, at::TensorList tensors, const at::Tensor& flat,
                                     const char* flat_name, bool tensors_written,
                                     std::optional<double> scale);

// One per-tensor state list of an optimizer op, e.g. {"exp_avg", exp_avg}.
struct NamedList {
  const char* name;
  at::TensorList tensors;
};

// Fused optimizer ops. `params` are all on one device, of one dtype, each dense and
// non-overlapping (contiguous, or permuted like channels_last or a transposed matrix): float32,
// with `states` float32, `grads` float32, bfloat16 or float16 (one dtype for all) and
// `param_copy` empty or the same length, bfloat16 or float16; or bfloat16/float16, with `states`
// and `grads` in that dtype and no `param_copy`. Each list matches params element-wise in numel,
// device and memory order (both contiguous, or the same sizes and strides), so the kernels step
// all of them linearly from data_ptr(). No tensor overlaps params[i] or another list's i-th
// tensor.
void check_optim_lists(const char* op, at::TensorList params, at::TensorList grads,
                       std::initializer_list<NamedList> states, at::TensorList param_copy);

// The optimizer ops' optional tensor arguments, read by the kernels (on the device for CUDA).
struct DeviceScalars {
  const std::optional<at::Tensor>& lr_tensor;  // one element, float32/float64
  at::TensorList state_steps;                  // empty, or one float32 scalar per param (Adam)
  const std::optional<at::Tensor>& amp_scale;  // one float32 element
  const std::optional<at::Tensor>& found_inf;  // one float32 element
};

// The tensors of one adam8bit_step_ call (schemas.cpp): exp_avg[i] and exp_avg_sq[i] are both
// uint8 codes (params[i] contiguous, each scale list entry one float32 per block of
// numel / scale.numel() elements, at most kMaxQuantBlock) or both plain state in the param's dtype
// and layout (empty scale entries).
struct Adam8Args {
  at::TensorList params, grads, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_copy;
  const at::Tensor& qmap_s;  // torchao's signed map (exp_avg): 256 sorted float32 entries
  const at::Tensor& qmap_u;  // its unsigned map (exp_avg_sq)
};

// The addresses of the lr tensor and amp scale of `s` (checked), for apply_scalars().
ScalarPtrs scalar_ptrs(const DeviceScalars& s);

// Every argument of adam_step_ / sgd_step_, lists and hyper-parameters (same order as the op).
// The tensors of `scalars` must be on the params' device; their values are checked only when
// that is the CPU (reading a GPU value would synchronize).
void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                     at::TensorList exp_avg_sq, at::TensorList param_copy, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step,
                     std::optional<double> grad_scale, const DeviceScalars& scalars);
void check_adam8_args(const Adam8Args& a, double lr, double beta1, double beta2, double eps,
                      double weight_decay, int64_t step, std::optional<double> grad_scale,
                      const std::optional<at::Tensor>& found_inf);
void check_sgd_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                    at::TensorList param_copy, double lr, double momentum, double dampening,
                    bool nesterov, double weight_decay, std::optional<double> grad_scale,
                    const DeviceScalars& scalars);

}  // namespace leanddp::ops
