// CPU kernels of the fused optimizer steps (adam_step_, sgd_step_).
//
// These are the real host path: they will step offloaded optimizer state. at::parallel_for splits
// the concatenation of the list into equal element ranges (ConcatRange in chunks.h); each worker
// walks its range in L1-sized blocks: bf16/fp16 tensors (gradients; parameters and state when
// the parameters are bf16/fp16) are upcast into per-thread float buffers (fp16 parameters,
// gradients and state without a copy: one pass in registers instead, CpuLoops::adam_half), the
// vectorized update runs (cpu_kernels.h), and what changed is rounded back (and the low-precision
// parameter copy written) from the block while it is still in cache. Every tensor is read and
// written once.
#include "checks.h"
#include "chunks.h"  // ConcatRange
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <type_traits>

namespace leanddp::ops {
namespace {

constexpr int64_t kBlockElems = 512;  // elements per inner pass: a few KiB per stream
// Fewer elements than this per thread cost more in threading than they save.
constexpr int64_t kGrainElems = 32 << 10;

std::vector<void*> ptrs(at::TensorList list) {
  std::vector<void*> out(list.size());
  for (size_t i = 0; i < list.size(); ++i) out[i] = list[i].data_ptr();
  return out;
}

// Runs step(tensor, first, p, g, s0, s1, n) for every block of every tensor, in parallel, on
// floats (`first`: the block's first element in its tensor; s0/s1: the block of state lists 0
// and 1, nullptr if absent); bf16/fp16 parameters and state are rounded back after the step, and
// param_copy is refreshed from the updated block.
template <typename Step>
void for_each_block(at::TensorList params, at::TensorList grads, at::TensorList state0,
                    at::TensorList state1, at::TensorList param_copy, const Step& step) {
  const size_t n = params.size();
  if (n == 0) return;
  const auto param_dtype = params[0].scalar_type();  // the state's dtype too (checks.h)
  const auto grad_dtype = grads[0].scalar_type();
  const bool low = param_dtype != at::kFloat;
  const bool has_copy = !param_copy.empty();
  const auto copy_dtype = has_copy ? param_copy[0].scalar_type() : at::kBFloat16;

  const auto p_ptr = ptrs(params);
  const auto s0_ptr = ptrs(state0);
  const auto s1_ptr = ptrs(state1);
  const auto copy_ptr = ptrs(param_copy);
  std::vector<void*> g_ptr(n);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    // Read only (the buffer is converted, never written back).
    g_ptr[i] = const_cast<void*>(grads[i].const_data_ptr());
    numels[i] = params[i].numel();
  }
  const ConcatRange range(numels);

  struct Buffers {
    alignas(64) float g[kBlockElems];
    alignas(64) float p[kBlockElems];
    alignas(64) float s0[kBlockElems];
    alignas(64) float s1[kBlockElems];
  };
  auto piece = [&](int32_t t, int64_t begin, int64_t len, Buffers& buf) {
    for (int64_t b = begin; b < begin + len; b += kBlockElems) {
      const int64_t nb = std::min(kBlockElems, begin + len - b);
      const float* g = as_float(grad_dtype, g_ptr[t], b, nb, buf.g);
      float* p = as_float(param_dtype, p_ptr[t], b, nb, buf.p);
      float* s0 = s0_ptr.empty() ? nullptr : as_float(param_dtype, s0_ptr[t], b, nb, buf.s0);
      float* s1 = s1_ptr.empty() ? nullptr : as_float(param_dtype, s1_ptr[t], b, nb, buf.s1);
      step(t, b, p, g, s0, s1, nb);
      if (low) {
        store_low(param_dtype, p, p_ptr[t], b, nb);
        if (s0) store_low(param_dtype, s0, s0_ptr[t], b, nb);
        if (s1) store_low(param_dtype, s1, s1_ptr[t], b, nb);
      }
      if (has_copy) store_low(copy_dtype, p, copy_ptr[t], b, nb);
    }
  };
  at::parallel_for(0, range.total(), kGrainElems, [&](int64_t first, int64_t last) {
    auto buf = std::make_unique<Buffers>();
    range.for_each_piece(
        first, last, [&](int32_t t, int64_t begin, int64_t len) { piece(t, begin, len, *buf); });
  });
}

// T (fp16) parameters, gradients and state, no parameter copy, and a one-pass loop for T
// (has_loop; CpuLoops::adam_half, sgd_half): runs step(tensor, begin, len) on every piece of
// every tensor, in parallel, and returns true; otherwise returns false and does nothing.
template <typename T, typename Step>
bool for_each_low_piece(at::TensorList params, at::TensorList grads, at::TensorList param_copy,
                        bool has_loop, const Step& step) {
  constexpr auto dtype = c10::CppTypeToScalarType<T>::value;
  if (!has_loop || params.empty() || params[0].scalar_type() != dtype ||
      grads[0].scalar_type() != dtype || !param_copy.empty()) {
    return false;
  }
  std::vector<int64_t> numels(params.size());
  for (size_t i = 0; i < params.size(); ++i) numels[i] = params[i].numel();
  const ConcatRange range(numels);
  at::parallel_for(0, range.total(), kGrainElems,
                   [&](int64_t first, int64_t last) { range.for_each_piece(first, last, step); });
  return true;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                   at::TensorList exp_avg_sq, at::TensorList param_copy, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t step,
                   bool decoupled_weight_decay, bool maximize, std::optional<double> grad_scale,
                   at::TensorList state_steps, const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& amp_scale,
                   const std::optional<at::Tensor>& found_inf, at::OptionalIntArrayRef tail_from) {
  const DeviceScalars scalars{lr_tensor, state_steps, amp_scale, found_inf};
  check_adam_args(params, grads, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps,
                  weight_decay, step, grad_scale, scalars);
  TORCH_CHECK_VALUE(!tail_from.has_value() || tail_from->size() == params.size(),
                    "leanddp::adam_step_: tail_from has ",
                    tail_from.has_value() ? tail_from->size() : 0, " entries but params has ",
                    params.size(), " tensors");
  // (empty lists reach this kernel when a scalar tensor is on the CPU)
  if (skipped(found_inf) || params.empty()) return;
  // The scalar tensors are in host memory here: applied as the CUDA kernels apply them.
  const ScalarPtrs ptrs = scalar_ptrs(scalars);
  auto consts = make_adam_consts(lr, beta1, beta2, eps, weight_decay, step, decoupled_weight_decay,
                                 maximize, grad_scale);
  std::vector<AdamConsts> per_tensor(state_steps.size(), consts);
  for (size_t i = 0; i < state_steps.size(); ++i) {
    apply_scalars(per_tensor[i], ptrs, state_steps[i].const_data_ptr<float>());
  }
  apply_scalars(consts, ptrs, nullptr);
  const auto& loops = cpu_loops();
  // Where each tensor's tail starts: torch's kernel steps whole 32-byte vectors of the
  // parameters' dtype with its vector arithmetic (AVX2; with AVX-512 its 64-byte vectors, then
  // its compiler vectorizes the scalar loop 32 bytes at a time), the rest in its scalar loop.
  // A piece of a larger tensor (tail_from) takes the larger tensor's tail.
  std::vector<int64_t> tail(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    tail[i] = tail_from.has_value() ? std::clamp<int64_t>((*tail_from)[i], 0, n)
                                    : adam_tail_start(n, params[i].element_size());
  }
  // fp16: one pass over the tensors' own memory, where the instruction set converts fp16
  const auto one_pass = [&](auto loop, auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    return for_each_low_piece<T>(
        params, grads, param_copy, loop != nullptr, [&](int32_t t, int64_t begin, int64_t len) {
          const int64_t from = std::clamp<int64_t>(tail[t] - begin, 0, len);
          loop(at_elem<T>(params[t], begin), at_elem<const T>(grads[t], begin),
               at_elem<T>(exp_avg[t], begin), at_elem<T>(exp_avg_sq[t], begin), len, from,
               per_tensor.empty() ? consts : per_tensor[t]);
        });
  };
  if (one_pass(loops.adam_half, static_cast<c10::Half*>(nullptr))) return;
  for_each_block(
      params, grads, exp_avg, exp_avg_sq, param_copy,
      [&](int32_t t, int64_t first, float* p, const float* g, float* m, float* v, int64_t n) {
        const int64_t from = std::clamp<int64_t>(tail[t] - first, 0, n);
        loops.adam(p, g, m, v, n, from, per_tensor.empty() ? consts : per_tensor[t]);
      });
}

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                  at::TensorList param_copy, double lr, double momentum, double dampening,
                  bool nesterov, double weight_decay, bool maximize, bool first_step,
                  std::optional<double> grad_scale, const std::optional<at::Tensor>& lr_tensor,
                  const std::optional<at::Tensor>& amp_scale,
                  const std::optional<at::Tensor>& found_inf) {
  const DeviceScalars scalars{lr_tensor, {}, amp_scale, found_inf};
  check_sgd_args(params, grads, momentum_buffer, param_copy, lr, momentum, dampening, nesterov,
                 weight_decay, grad_scale, scalars);
  if (skipped(found_inf)) return;
  auto consts = make_sgd_consts(lr, momentum, dampening, nesterov, weight_decay, maximize,
                                first_step, grad_scale);
  apply_scalars(consts, scalar_ptrs(scalars));
  const auto& loops = cpu_loops();
  const auto one_pass = [&](auto loop, auto* type) {  // (as in adam_step_cpu)
    using T = std::remove_pointer_t<decltype(type)>;
    return for_each_low_piece<T>(
        params, grads, param_copy, loop != nullptr, [&](int32_t t, int64_t begin, int64_t len) {
          T* buf = momentum_buffer.empty() ? nullptr : at_elem<T>(momentum_buffer[t], begin);
          loop(at_elem<T>(params[t], begin), at_elem<const T>(grads[t], begin), buf, len, consts);
        });
  };
  if (one_pass(loops.sgd_half, static_cast<c10::Half*>(nullptr))) return;
  const auto sgd = loops.sgd;
  for_each_block(params, grads, momentum_buffer, {}, param_copy,
                 [&](int32_t, int64_t, float* p, const float* g, float* buf, float*, int64_t n) {
                   sgd(p, g, buf, n, consts);
                 });
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
}

}  // namespace leanddp::ops
