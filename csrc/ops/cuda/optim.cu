// CUDA kernels of the fused optimizer steps: the whole list in one launch.
//
// One kernel template serves Adam(W) and SGD through a per-element "rule" that calls the same
// arithmetic as the CPU kernels (optim_math.h). Block b steps chunk b (chunks.h) of one tensor:
// four elements per thread per access (16-byte float loads, 8-byte bf16/fp16 loads) when every
// pointer of the chunk is aligned for it, element by element otherwise. Gradients are upcast and
// the optional bf16/fp16 parameter copy is written in the same pass. bf16/fp16 parameters keep
// their state in their own dtype and are stepped in float32 math, as torch's fused optimizers
// do. Device scalars (learning rate, step counts, GradScaler's scale and found_inf) are read by
// each block, so nothing is copied to the host.
#include "../checks.h"
#include "../optim_math.h"
#include "common.cuh"

#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

namespace leanddp::ops::cuda {
namespace {

constexpr int64_t kChunkElems = 16 << 10;  // one block's share of a tensor

struct OptimTensor {
  void* param;
  const void* grad;
  void* state0;       // exp_avg, or the momentum buffer (the param's dtype)
  void* state1;       // exp_avg_sq
  void* copy;         // bf16/fp16 copy of the updated parameter, or nullptr
  const float* step;  // Adam's device step count (1-based, this update), or nullptr
  int64_t numel;
};

// The device scalars of one call (null pointers: absent): those the rules apply
// (optim_math.h's apply_scalars, shared with the CPU kernels) and GradScaler's found_inf.
struct Scalars {
  ScalarPtrs apply;
  const float* found_inf;
};

struct AdamRule {
  static constexpr int kStates = 2;
  AdamConsts c;
  __device__ __forceinline__ void operator()(float& p, float g, float& s0, float& s1) const {
    adam_update_any</*kFma=*/true>(p, g, s0, s1, c);
  }
  __device__ __forceinline__ void prepare(const Scalars& s, const OptimTensor& t) {
    apply_scalars(c, s.apply, t.step);
  }
};

template <bool kMomentum>
struct SgdRule {
  static constexpr int kStates = kMomentum ? 1 : 0;
  SgdConsts c;
  __device__ __forceinline__ void operator()(float& p, float g, float& s0, float&) const {
    sgd_update</*kFma=*/true, kMomentum>(p, g, &s0, c);
  }
  __device__ __forceinline__ void prepare(const Scalars& s, const OptimTensor&) {
    apply_scalars(c, s.apply);
  }
};

// P: the parameters' (and state's) dtype; G: the gradients'; C: param_copy's.
template <typename Rule, typename P, typename G, typename C, bool kCopy>
__global__ void __launch_bounds__(kThreads)
    optim_kernel(const __grid_constant__ MetaArg meta, Rule rule, Scalars scalars) {
  const OptimTensor* tensors = meta.array<OptimTensor>(0);
  const Chunk* chunks = meta.array<Chunk>(1);
  // GradScaler found an inf/NaN: as torch's fused kernels, do nothing.
  if (scalars.found_inf && *scalars.found_inf != 0.0f) return;
  const Chunk ch = chunks[blockIdx.x];
  const OptimTensor t = tensors[ch.tensor];
  rule.prepare(scalars, t);
  const int64_t begin = chunk_begin(ch, kChunkElems);
  const int64_t n = chunk_len(ch, kChunkElems, t.numel);
  P* p = static_cast<P*>(t.param) + begin;
  const G* g = static_cast<const G*>(t.grad) + begin;
  P* s0 = Rule::kStates > 0 ? static_cast<P*>(t.state0) + begin : nullptr;
  P* s1 = Rule::kStates > 1 ? static_cast<P*>(t.state1) + begin : nullptr;
  C* copy = kCopy ? static_cast<C*>(t.copy) + begin : nullptr;

  constexpr size_t kPack = 4 * sizeof(P);
  const bool vec = aligned_to(p, kPack) && aligned_to(g, 4 * sizeof(G)) &&
                   (Rule::kStates < 1 || aligned_to(s0, kPack)) &&
                   (Rule::kStates < 2 || aligned_to(s1, kPack)) &&
                   (!kCopy || aligned_to(copy, 4 * sizeof(C)));
  int64_t done = 0;
  if (vec) {
    const int64_t n4 = n / 4 * 4;
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < n4; i += 4 * blockDim.x) {
      float pv[4], gv[4], a[4] = {}, b[4] = {};
      load4(p + i, pv);
      load4(g + i, gv);
      if constexpr (Rule::kStates > 0) load4(s0 + i, a);
      if constexpr (Rule::kStates > 1) load4(s1 + i, b);
#pragma unroll
      for (int k = 0; k < 4; ++k) rule(pv[k], gv[k], a[k], b[k]);
      store4(p + i, pv);
      if constexpr (Rule::kStates > 0) store4(s0 + i, a);
      if constexpr (Rule::kStates > 1) store4(s1 + i, b);
      if constexpr (kCopy) store4(copy + i, pv);
    }
    done = n4;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float pv = static_cast<float>(p[i]);
    float a = Rule::kStates > 0 ? static_cast<float>(s0[i]) : 0.0f;
    float b = Rule::kStates > 1 ? static_cast<float>(s1[i]) : 0.0f;
    rule(pv, static_cast<float>(g[i]), a, b);
    p[i] = static_cast<P>(pv);
    if constexpr (Rule::kStates > 0) s0[i] = static_cast<P>(a);
    if constexpr (Rule::kStates > 1) s1[i] = static_cast<P>(b);
    if constexpr (kCopy) copy[i] = static_cast<C>(pv);
  }
}

// The device addresses of the optional scalar tensors.
Scalars scalars_of(const DeviceScalars& s) {
  Scalars out{};
  out.apply = scalar_ptrs(s);
  out.found_inf = s.found_inf.has_value() ? s.found_inf->const_data_ptr<float>() : nullptr;
  return out;
}

// An upper bound of the metadata bytes launch_optim adds for `params`.
size_t meta_bound(at::TensorList params) {
  return meta_bytes<OptimTensor>(params.size()) +
         meta_bytes<Chunk>(chunk_bound(params, kChunkElems));
}

// Launches optim_kernel<Rule, ...> over `params` with the param, grad and copy dtypes of the
// lists.
template <typename Rule>
void launch_optim(const Rule& rule, const DeviceScalars& device_scalars, at::TensorList params,
                  at::TensorList grads, at::TensorList state0, at::TensorList state1,
                  at::TensorList param_copy) {
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  std::vector<OptimTensor> tensors(params.size());
  std::vector<int64_t> numels(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& steps = device_scalars.state_steps;
    tensors[i] = {params[i].data_ptr(),
                  grads[i].const_data_ptr(),
                  state0.empty() ? nullptr : state0[i].data_ptr(),
                  state1.empty() ? nullptr : state1[i].data_ptr(),
                  param_copy.empty() ? nullptr : param_copy[i].data_ptr(),
                  steps.empty() ? nullptr : steps[i].const_data_ptr<float>(),
                  params[i].numel()};
    numels[i] = params[i].numel();
  }
  const auto chunks = plan_chunks(numels, kChunkElems);
  if (chunks.empty()) return;
  LaunchMeta meta;
  meta.add(tensors);  // array 0
  meta.add(chunks);   // array 1
  const MetaArg& meta_arg = meta.finish(params[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const Scalars scalars = scalars_of(device_scalars);

  auto launch = [&](auto param_tag, auto grad_tag, auto copy_tag, auto has_copy) {
    using P = typename decltype(param_tag)::type;
    using G = typename decltype(grad_tag)::type;
    using C = typename decltype(copy_tag)::type;
    optim_kernel<Rule, P, G, C, decltype(has_copy)::value>
        <<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(meta_arg, rule, scalars);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  dispatch_optim_dtypes(params, grads, param_copy, launch);
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                    at::TensorList exp_avg_sq, at::TensorList param_copy, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step,
                    bool decoupled_weight_decay, bool maximize, std::optional<double> grad_scale,
                    at::TensorList state_steps, const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& amp_scale,
                    const std::optional<at::Tensor>& found_inf,
                    at::OptionalIntArrayRef /*tail_from: torch's CUDA kernel has no tail*/) {
  const DeviceScalars scalars{lr_tensor, state_steps, amp_scale, found_inf};
  check_adam_args(params, grads, exp_avg, exp_avg_sq, param_copy, lr, beta1, beta2, eps,
                  weight_decay, step, grad_scale, scalars);
  // (the device first: the capture check asks about the current stream of the params' device)
  const c10::cuda::OptionalCUDAGuard guard(params.empty() ? std::nullopt
                                                          : std::optional(params[0].device()));
  refuse_graph_capture("leanddp::adam_step_", meta_bound(params));
  const AdamRule rule{make_adam_consts(lr, beta1, beta2, eps, weight_decay, step,
                                       decoupled_weight_decay, maximize, grad_scale)};
  launch_optim(rule, scalars, params, grads, exp_avg, exp_avg_sq, param_copy);
}

void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                   at::TensorList param_copy, double lr, double momentum, double dampening,
                   bool nesterov, double weight_decay, bool maximize, bool first_step,
                   std::optional<double> grad_scale, const std::optional<at::Tensor>& lr_tensor,
                   const std::optional<at::Tensor>& amp_scale,
                   const std::optional<at::Tensor>& found_inf) {
  const DeviceScalars scalars{lr_tensor, {}, amp_scale, found_inf};
  check_sgd_args(params, grads, momentum_buffer, param_copy, lr, momentum, dampening, nesterov,
                 weight_decay, grad_scale, scalars);
  // (the device first: the capture check asks about the current stream of the params' device)
  const c10::cuda::OptionalCUDAGuard guard(params.empty() ? std::nullopt
                                                          : std::optional(params[0].device()));
  refuse_graph_capture("leanddp::sgd_step_", meta_bound(params));
  const auto consts = make_sgd_consts(lr, momentum, dampening, nesterov, weight_decay, maximize,
                                      first_step, grad_scale);
  if (momentum_buffer.empty()) {
    launch_optim(SgdRule<false>{consts}, scalars, params, grads, {}, {}, param_copy);
  } else {
    launch_optim(SgdRule<true>{consts}, scalars, params, grads, momentum_buffer, {}, param_copy);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(leanddp, CUDA, m) {
  m.impl("adam_step_", &adam_step_cuda);
  m.impl("sgd_step_", &sgd_step_cuda);
}

}  // namespace leanddp::ops::cuda
