// CPU kernels of the fused optimizer steps (adam_step_, sgd_step_).
//
// These are the real host path: they will step offloaded optimizer state. at::parallel_for splits
// the concatenation of the list into equal element ranges (ConcatRange in chunks.h); each worker
// walks its range in L1-sized blocks: bf16/fp16 gradients are upcast into a per-thread buffer, the
// vectorized update runs (cpu_kernels.h), and the low-precision parameter copy is written from the
// block while it is still in cache. Every tensor is read and written once.
#include "checks.h"
#include "chunks.h"  // ConcatRange
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace leanddp::ops {
namespace {

constexpr int64_t kBlockElems = 1024;  // elements per inner pass: a few KiB per stream
// Fewer elements than this per thread cost more in threading than they save.
constexpr int64_t kGrainElems = 32 << 10;

std::vector<float*> float_ptrs(at::TensorList list) {
  std::vector<float*> out(list.size());
  for (size_t i = 0; i < list.size(); ++i) out[i] = list[i].data_ptr<float>();
  return out;
}

// Runs step(tensor, first_element, n, p, g) for every block of every tensor, in parallel, with
// `g` always float, then refreshes param_copy from the updated block.
template <typename Step>
void for_each_block(at::TensorList params, at::TensorList grads, at::TensorList param_copy,
                    const Step& step) {
  const size_t n = params.size();
  if (n == 0) return;
  const auto& loops = cpu_loops();
  const auto grad_dtype = grads[0].scalar_type();
  const bool has_copy = !param_copy.empty();
  const bool copy_bf16 = has_copy && param_copy[0].scalar_type() == at::kBFloat16;

  const auto p_ptr = float_ptrs(params);
  std::vector<const void*> g_ptr(n);
  std::vector<void*> copy_ptr(n, nullptr);
  std::vector<int64_t> numels(n);
  for (size_t i = 0; i < n; ++i) {
    g_ptr[i] = grads[i].const_data_ptr();
    if (has_copy) copy_ptr[i] = param_copy[i].data_ptr();
    numels[i] = params[i].numel();
  }
  const ConcatRange range(numels);

  auto piece = [&](int32_t t, int64_t begin, int64_t len, float* gbuf) {
    for (int64_t b = begin; b < begin + len; b += kBlockElems) {
      const int64_t n_block = std::min(kBlockElems, begin + len - b);
      const float* g;
      if (grad_dtype == at::kFloat) {
        g = static_cast<const float*>(g_ptr[t]) + b;
      } else if (grad_dtype == at::kBFloat16) {
        loops.bf16_to_float(static_cast<const c10::BFloat16*>(g_ptr[t]) + b, gbuf, n_block);
        g = gbuf;
      } else {
        loops.half_to_float(static_cast<const c10::Half*>(g_ptr[t]) + b, gbuf, n_block);
        g = gbuf;
      }
      float* p = p_ptr[t] + b;
      step(t, b, n_block, p, g);
      if (!has_copy) continue;
      if (copy_bf16) {
        loops.float_to_bf16(p, static_cast<c10::BFloat16*>(copy_ptr[t]) + b, n_block);
      } else {
        loops.float_to_half(p, static_cast<c10::Half*>(copy_ptr[t]) + b, n_block);
      }
    }
  };
  at::parallel_for(0, range.total(), kGrainElems, [&](int64_t first, int64_t last) {
    alignas(64) float gbuf[kBlockElems];
    range.for_each_piece(
        first, last, [&](int32_t t, int64_t begin, int64_t len) { piece(t, begin, len, gbuf); });
  });
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                   at::TensorList exp_avg_sq, at::TensorList param_copy, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t step,
                   bool decoupled_weight_decay, bool maximize, std::optional<double> grad_scale) {
  check_adam_args(params, grads, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps,
                  weight_decay, step, grad_scale);
  const auto consts = make_adam_consts(lr, beta1, beta2, eps, weight_decay, step,
                                       decoupled_weight_decay, maximize, grad_scale);
  const auto m = float_ptrs(exp_avg);
  const auto v = float_ptrs(exp_avg_sq);
  const auto adam = cpu_loops().adam;
  for_each_block(params, grads, param_copy,
                 [&](int32_t t, int64_t b, int64_t n, float* p, const float* g) {
                   adam(p, g, m[t] + b, v[t] + b, n, consts);
                 });
}

void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                  at::TensorList param_copy, double lr, double momentum, double dampening,
                  bool nesterov, double weight_decay, bool maximize, bool first_step,
                  std::optional<double> grad_scale) {
  check_sgd_args(params, grads, momentum_buffer, param_copy, lr, momentum, dampening, nesterov,
                 weight_decay, grad_scale);
  const auto consts = make_sgd_consts(lr, momentum, dampening, nesterov, weight_decay, maximize,
                                      first_step, grad_scale);
  const auto buf = float_ptrs(momentum_buffer);
  const auto sgd = cpu_loops().sgd;
  for_each_block(params, grads, param_copy,
                 [&](int32_t t, int64_t b, int64_t n, float* p, const float* g) {
                   sgd(p, g, buf.empty() ? nullptr : buf[t] + b, n, consts);
                 });
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CPU, m) {
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
}

}  // namespace leanddp::ops
