#include "checks.h"

#include "flat_common.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace leanddp::ops {
namespace {

// Byte range [lo, hi) spanned by a tensor's elements (torch strides are never negative).
struct Span {
  uintptr_t lo = 0;
  uintptr_t hi = 0;
};

Span span_of(const at::Tensor& t) {
  if (t.numel() == 0) return {};
  const auto lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

bool overlaps(Span a, Span b) { return a.lo < b.hi && b.lo < a.hi; }

// One tensor an op touches: where, whether it is written, and its name for messages.
struct Access {
  Span span;
  bool written;
  const char* name;
  size_t index;
};

// Throws if a written tensor shares memory with any other tensor of the call (readers may share
// memory with each other). One sweep over the accesses sorted by address: an access conflicts
// when it starts below the furthest end reached by an earlier access it must not overlap.
void check_no_shared_writes(const char* op, std::vector<Access>& accesses) {
  std::sort(accesses.begin(), accesses.end(),
            [](const Access& a, const Access& b) { return a.span.lo < b.span.lo; });
  const Access* reach_any = nullptr;      // earlier access reaching furthest
  const Access* reach_written = nullptr;  // earlier written access reaching furthest
  for (const auto& a : accesses) {
    if (a.span.lo == a.span.hi) continue;  // empty tensor
    const Access* other = nullptr;
    if (a.written && reach_any != nullptr && a.span.lo < reach_any->span.hi) {
      other = reach_any;
    } else if (reach_written != nullptr && a.span.lo < reach_written->span.hi) {
      other = reach_written;
    }
    TORCH_CHECK_VALUE(other == nullptr, op, ": ", other->name, "[", other->index, "] and ", a.name,
                      "[", a.index, "] share memory");
    if (reach_any == nullptr || a.span.hi > reach_any->span.hi) reach_any = &a;
    if (a.written && (reach_written == nullptr || a.span.hi > reach_written->span.hi)) {
      reach_written = &a;
    }
  }
}

bool is_grad_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

bool is_low_precision(at::ScalarType s) { return s == at::kBFloat16 || s == at::kHalf; }

// True when the kernels may step `t` and `param` element by element in memory order, from their
// data_ptr() on: both contiguous (sizes may differ), or both dense with the same sizes and the
// same strides in every dim of size > 1 (the same permutation: channels_last, transposed, ...).
bool same_memory_order(const at::Tensor& t, const at::Tensor& param) {
  if (t.is_contiguous() && param.is_contiguous()) return true;
  if (t.sizes() != param.sizes() || !t.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) != param.stride(d)) return false;
  }
  return true;
}

}  // namespace

std::vector<int64_t> check_flat_args(const char* op, at::TensorList tensors, const at::Tensor& flat,
                                     const char* flat_name, bool tensors_written,
                                     std::optional<double> scale) {
  TORCH_CHECK_VALUE(flat.dim() == 1, op, ": ", flat_name, " must be 1-D, got shape ", flat.sizes());
  TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": ", flat_name, " must be contiguous");
  std::vector<int64_t> offsets(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK_TYPE(t.scalar_type() == flat.scalar_type(), op, ": tensors[", i, "] has dtype ",
                     t.scalar_type(), " but ", flat_name, " has dtype ", flat.scalar_type(),
                     "; all tensors must share ", flat_name, "'s dtype");
    TORCH_CHECK_VALUE(t.device() == flat.device(), op, ": tensors[", i, "] is on ", t.device(),
                      " but ", flat_name, " is on ", flat.device());
    if (tensors_written) {
      TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensors[", i,
                        "] has internally overlapping memory (e.g. an expanded tensor) and "
                        "cannot be written");
    }
    offsets[i + 1] = offsets[i] + t.numel();
  }
  TORCH_CHECK_VALUE(offsets.back() <= flat.numel(), op, ": ", flat_name, " has ", flat.numel(),
                    " elements but the tensors hold ", offsets.back());
  if (scale.has_value()) {
    const auto dt = flat.scalar_type();
    TORCH_CHECK_TYPE(
        dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16, op,
        ": scale needs dtype Float, Double, Half or BFloat16, got ", dt);
    TORCH_CHECK_VALUE(std::isfinite(*scale), op, ": scale must be finite, got ", *scale);
  }
  const auto* base = static_cast<const char*>(flat.const_data_ptr());
  const Span touched{reinterpret_cast<uintptr_t>(base),
                     reinterpret_cast<uintptr_t>(base + offsets.back() * flat.element_size())};
  std::vector<Access> accesses;
  accesses.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    accesses.push_back({span_of(tensors[i]), tensors_written, "tensors", i});
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.numel() == 0 || !overlaps(accesses[i].span, touched)) continue;
    TORCH_CHECK_VALUE(is_flat_slice(t, flat, offsets[i]), op, ": tensors[", i, "] overlaps ",
                      flat_name, " outside its own slice [", offsets[i], ", ", offsets[i + 1],
                      "); only a tensor that is exactly its slice (dense, in any layout) may "
                      "share ",
                      flat_name, "'s memory");
  }
  if (tensors_written) check_no_shared_writes(op, accesses);  // sorts `accesses`
  return offsets;
}

void check_optim_lists(const char* op, at::TensorList params, at::TensorList grads,
                       std::initializer_list<NamedList> states, at::TensorList param_copy) {
  const size_t n = params.size();
  auto check_len = [&](const char* name, at::TensorList list) {
    TORCH_CHECK_VALUE(list.size() == n, op, ": ", name, " has ", list.size(),
                      " tensors but params has ", n);
  };
  check_len("grads", grads);
  for (const auto& s : states) check_len(s.name, s.tensors);
  if (!param_copy.empty()) check_len("param_copy", param_copy);
  if (n == 0) return;

  const auto device = params[0].device();
  auto check_like_param = [&](const char* name, size_t i, const at::Tensor& t) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
                      " but params[0] is on ", device);
    TORCH_CHECK_VALUE(t.numel() == p.numel(), op, ": ", name, "[", i, "] has ", t.numel(),
                      " elements but params[", i, "] has ", p.numel());
    if (&t == &p) {  // params[i] itself
      TORCH_CHECK_VALUE(p.is_non_overlapping_and_dense(), op, ": ", name, "[", i,
                        "] must be contiguous or dense in another layout (no gaps, no overlap), "
                        "got sizes ",
                        p.sizes(), " and strides ", p.strides());
    } else {
      TORCH_CHECK_VALUE(same_memory_order(t, p), op, ": ", name, "[", i,
                        "] must be laid out like params[", i, "]: both contiguous, or the same ",
                        "sizes and strides (got strides ", t.strides(), " and ", p.strides(), ")");
    }
  };
  const auto param_dtype = params[0].scalar_type();
  TORCH_CHECK_TYPE(param_dtype == at::kFloat || is_low_precision(param_dtype), op,
                   ": params[0] has dtype ", param_dtype, "; expected Float, BFloat16 or Half");
  const bool low = param_dtype != at::kFloat;
  // bf16/fp16 parameters: state and gradients in their dtype (as torch's fused optimizers).
  const auto state_dtype = low ? param_dtype : at::kFloat;
  const auto grad_dtype = grads[0].scalar_type();
  TORCH_CHECK_TYPE(is_grad_dtype(grad_dtype), op, ": grads[0] has dtype ", grad_dtype,
                   "; expected Float, BFloat16 or Half");
  TORCH_CHECK_TYPE(!low || grad_dtype == param_dtype, op, ": grads[0] has dtype ", grad_dtype,
                   " but params are ", param_dtype, "; bf16/fp16 params take grads of their dtype");
  TORCH_CHECK_VALUE(!low || param_copy.empty(), op, ": param_copy must be empty when params are ",
                    param_dtype);
  const auto copy_dtype = param_copy.empty() ? at::kBFloat16 : param_copy[0].scalar_type();
  TORCH_CHECK_TYPE(is_low_precision(copy_dtype), op, ": param_copy[0] has dtype ", copy_dtype,
                   "; expected BFloat16 or Half");

  for (size_t i = 0; i < n; ++i) {
    check_like_param("params", i, params[i]);
    TORCH_CHECK_TYPE(params[i].scalar_type() == param_dtype, op, ": params[", i, "] has dtype ",
                     params[i].scalar_type(), " but params[0] has ", param_dtype,
                     "; all params must share one dtype");
    check_like_param("grads", i, grads[i]);
    TORCH_CHECK_TYPE(grads[i].scalar_type() == grad_dtype, op, ": grads[", i, "] has dtype ",
                     grads[i].scalar_type(), " but grads[0] has ", grad_dtype,
                     "; all grads must share one dtype");
    for (const auto& s : states) {
      const auto& t = s.tensors[i];
      check_like_param(s.name, i, t);
      TORCH_CHECK_TYPE(t.scalar_type() == state_dtype, op, ": ", s.name, "[", i, "] has dtype ",
                       t.scalar_type(), "; optimizer state of ", param_dtype, " params is ",
                       state_dtype);
    }
    if (!param_copy.empty()) {
      check_like_param("param_copy", i, param_copy[i]);
      TORCH_CHECK_TYPE(param_copy[i].scalar_type() == copy_dtype, op, ": param_copy[", i,
                       "] has dtype ", param_copy[i].scalar_type(), " but param_copy[0] has ",
                       copy_dtype);
    }
  }
  // Every written tensor (params, states, param_copy) must be disjoint from every other tensor.
  std::vector<Access> accesses;
  accesses.reserve(n * (3 + states.size()));
  for (size_t i = 0; i < n; ++i) {
    accesses.push_back({span_of(params[i]), true, "params", i});
    accesses.push_back({span_of(grads[i]), false, "grads", i});
    for (const auto& s : states) accesses.push_back({span_of(s.tensors[i]), true, s.name, i});
    if (!param_copy.empty()) accesses.push_back({span_of(param_copy[i]), true, "param_copy", i});
  }
  check_no_shared_writes(op, accesses);
}

namespace {

void check_finite_nonneg(const char* op, const char* name, double value) {
  TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0, op, ": ", name,
                    " must be finite and >= 0, got ", value);
}

void check_unit_interval(const char* op, const char* name, double value) {
  TORCH_CHECK_VALUE(value >= 0 && value < 1, op, ": ", name, " must be in [0, 1), got ", value);
}

void check_grad_scale(const char* op, std::optional<double> grad_scale) {
  TORCH_CHECK_VALUE(!grad_scale.has_value() || std::isfinite(*grad_scale), op,
                    ": grad_scale must be finite, got ", grad_scale.value_or(0.0));
}

// A one-element device scalar argument: dtype, numel and device; and, on the CPU, its value.
void check_scalar(const char* op, const char* name, const at::Tensor& t, at::TensorList params,
                  bool allow_double) {
  TORCH_CHECK_VALUE(t.numel() == 1, op, ": ", name, " must have one element, got ", t.numel());
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kFloat || (allow_double && t.scalar_type() == at::kDouble), op, ": ",
      name, " has dtype ", t.scalar_type(), "; expected Float", allow_double ? " or Double" : "");
  if (!params.empty()) {
    TORCH_CHECK_VALUE(t.device() == params[0].device(), op, ": ", name, " is on ", t.device(),
                      " but params[0] is on ", params[0].device());
  }
}

void check_scalars(const char* op, at::TensorList params, const DeviceScalars& s) {
  if (s.lr_tensor.has_value()) {
    check_scalar(op, "lr_tensor", *s.lr_tensor, params, /*allow_double=*/true);
    const at::Tensor& lr = *s.lr_tensor;
    if (lr.is_cpu()) {  // (read directly: no dispatched op, nothing to synchronize)
      check_finite_nonneg(op, "lr_tensor",
                          lr.scalar_type() == at::kDouble ? *lr.const_data_ptr<double>()
                                                          : *lr.const_data_ptr<float>());
    }
  }
  if (s.amp_scale.has_value()) check_scalar(op, "amp_scale", *s.amp_scale, params, false);
  if (s.found_inf.has_value()) check_scalar(op, "found_inf", *s.found_inf, params, false);
  if (!s.state_steps.empty()) {
    TORCH_CHECK_VALUE(s.state_steps.size() == params.size(), op, ": state_steps has ",
                      s.state_steps.size(), " tensors but params has ", params.size());
    for (const auto& t : s.state_steps) check_scalar(op, "state_steps[i]", t, params, false);
  }
}

// Adam's hyper-parameters (adam_step_, adam8bit_step_).
void check_adam_hyper(const char* op, double lr, double beta1, double beta2, double eps,
                      double weight_decay, int64_t step, std::optional<double> grad_scale) {
  check_finite_nonneg(op, "lr", lr);
  check_unit_interval(op, "beta1", beta1);
  check_unit_interval(op, "beta2", beta2);
  check_finite_nonneg(op, "eps", eps);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK_VALUE(step >= 1, op, ": step must be >= 1 (the 1-based count of this update), got ",
                    step);
  check_grad_scale(op, grad_scale);
}

}  // namespace

void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avg,
                     at::TensorList exp_avg_sq, at::TensorList param_copy, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int64_t step,
                     std::optional<double> grad_scale, const DeviceScalars& scalars) {
  constexpr const char* op = "leanddp::adam_step_";
  check_adam_hyper(op, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  check_scalars(op, params, scalars);
  check_optim_lists(op, params, grads, {{"exp_avg", exp_avg}, {"exp_avg_sq", exp_avg_sq}},
                    param_copy);
}

void check_sgd_args(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffer,
                    at::TensorList param_copy, double lr, double momentum, double dampening,
                    bool nesterov, double weight_decay, std::optional<double> grad_scale,
                    const DeviceScalars& scalars) {
  constexpr const char* op = "leanddp::sgd_step_";
  check_finite_nonneg(op, "lr", lr);
  check_finite_nonneg(op, "momentum", momentum);
  TORCH_CHECK_VALUE(std::isfinite(dampening), op, ": dampening must be finite, got ", dampening);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK_VALUE(!nesterov || (momentum > 0 && dampening == 0), op,
                    ": nesterov needs momentum > 0 and dampening == 0");
  check_grad_scale(op, grad_scale);
  check_scalars(op, params, scalars);
  if (momentum == 0) {
    TORCH_CHECK_VALUE(momentum_buffer.empty(), op,
                      ": momentum_buffer must be empty when momentum is 0");
    check_optim_lists(op, params, grads, {}, param_copy);
  } else {
    check_optim_lists(op, params, grads, {{"momentum_buffer", momentum_buffer}}, param_copy);
  }
}

void check_adam8_args(const Adam8Args& a, double lr, double beta1, double beta2, double eps,
                      double weight_decay, int64_t step, std::optional<double> grad_scale,
                      const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "leanddp::adam8bit_step_";
  check_adam_hyper(op, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  const DeviceScalars scalars{std::nullopt, {}, std::nullopt, found_inf};
  check_scalars(op, a.params, scalars);
  // params, grads and param_copy as for adam_step_; the state lists are checked here.
  check_optim_lists(op, a.params, a.grads, {}, a.param_copy);
  const size_t n = a.params.size();
  for (const NamedList& l : {NamedList{"exp_avg", a.exp_avg},
                             {"exp_avg_sq", a.exp_avg_sq},
                             {"exp_avg_scale", a.exp_avg_scale},
                             {"exp_avg_sq_scale", a.exp_avg_sq_scale}}) {
    TORCH_CHECK_VALUE(l.tensors.size() == n, op, ": ", l.name, " has ", l.tensors.size(),
                      " tensors but params has ", n);
  }
  if (n == 0) return;
  const auto device = a.params[0].device();
  for (const auto& [name, q] : {std::pair<const char*, const at::Tensor&>{"qmap_signed", a.qmap_s},
                                {"qmap_unsigned", a.qmap_u}}) {
    TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat, op, ": ", name, " has dtype ", q.scalar_type(),
                     "; expected Float");
    TORCH_CHECK_VALUE(q.dim() == 1 && q.numel() == kQmapSize && q.is_contiguous(), op, ": ", name,
                      " must be a contiguous 1-D tensor of ", kQmapSize, " entries, got shape ",
                      q.sizes());
    TORCH_CHECK_VALUE(q.device() == device, op, ": ", name, " is on ", q.device(),
                      " but params[0] is on ", device);
  }
  std::vector<Access> accesses;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = a.params[i];
    const at::Tensor* states[2] = {&a.exp_avg[i], &a.exp_avg_sq[i]};
    const at::Tensor* scales[2] = {&a.exp_avg_scale[i], &a.exp_avg_sq_scale[i]};
    const char* names[2] = {"exp_avg", "exp_avg_sq"};
    const char* scale_names[2] = {"exp_avg_scale", "exp_avg_sq_scale"};
    const bool quantized = states[0]->scalar_type() == at::kByte;
    for (int k = 0; k < 2; ++k) {
      const at::Tensor& s = *states[k];
      const at::Tensor& sc = *scales[k];
      TORCH_CHECK_VALUE(s.device() == device && sc.device() == device, op, ": ", names[k], "[", i,
                        "] and ", scale_names[k], "[", i, "] must be on ", device);
      TORCH_CHECK_VALUE(s.numel() == p.numel(), op, ": ", names[k], "[", i, "] has ", s.numel(),
                        " elements but params[", i, "] has ", p.numel());
      if (quantized) {
        TORCH_CHECK_TYPE(s.scalar_type() == at::kByte, op, ": ", names[k], "[", i, "] has dtype ",
                         s.scalar_type(), " but exp_avg[", i,
                         "] is Byte; both moments are 8-bit codes or both plain");
        TORCH_CHECK_VALUE(p.is_contiguous() && s.is_contiguous(), op, ": params[", i, "] and ",
                          names[k], "[", i, "] must be contiguous for 8-bit state");
        TORCH_CHECK_TYPE(sc.scalar_type() == at::kFloat, op, ": ", scale_names[k], "[", i,
                         "] has dtype ", sc.scalar_type(), "; expected Float");
        const int64_t blocks = sc.numel();
        TORCH_CHECK_VALUE(
            sc.dim() == 1 && sc.is_contiguous() && blocks > 0 && blocks <= p.numel() &&
                p.numel() % blocks == 0 && p.numel() / blocks <= kMaxQuantBlock,
            op, ": ", scale_names[k], "[", i, "] must be a contiguous 1-D tensor of ",
            "one scale per block of at most ", kMaxQuantBlock, " elements dividing params[", i,
            "] (", p.numel(), " elements), got shape ", sc.sizes());
        TORCH_CHECK_VALUE(blocks == scales[0]->numel(), op, ": ", scale_names[k], "[", i, "] has ",
                          blocks, " blocks but exp_avg_scale[", i, "] has ", scales[0]->numel());
      } else {
        TORCH_CHECK_TYPE(s.scalar_type() == p.scalar_type(), op, ": ", names[k], "[", i,
                         "] has dtype ", s.scalar_type(), "; plain state of ", p.scalar_type(),
                         " params is ", p.scalar_type(), " (or Byte codes with scales)");
        TORCH_CHECK_VALUE(same_memory_order(s, p), op, ": ", names[k], "[", i,
                          "] must be laid out like params[", i, "]");
        TORCH_CHECK_VALUE(sc.numel() == 0, op, ": ", scale_names[k], "[", i,
                          "] must be empty for plain (not Byte) state, got ", sc.numel(),
                          " elements");
      }
      accesses.push_back({span_of(s), true, names[k], i});
      accesses.push_back({span_of(sc), true, scale_names[k], i});
    }
    accesses.push_back({span_of(p), true, "params", i});
    accesses.push_back({span_of(a.grads[i]), false, "grads", i});
    if (!a.param_copy.empty())
      accesses.push_back({span_of(a.param_copy[i]), true, "param_copy", i});
  }
  accesses.push_back({span_of(a.qmap_s), false, "qmap_signed", 0});
  accesses.push_back({span_of(a.qmap_u), false, "qmap_unsigned", 0});
  check_no_shared_writes(op, accesses);
}

ScalarPtrs scalar_ptrs(const DeviceScalars& s) {
  ScalarPtrs out;
  if (s.lr_tensor.has_value()) {
    if (s.lr_tensor->scalar_type() == at::kDouble) {
      out.lr_d = s.lr_tensor->const_data_ptr<double>();
    } else {
      out.lr_f = s.lr_tensor->const_data_ptr<float>();
    }
  }
  if (s.amp_scale.has_value()) out.amp_scale = s.amp_scale->const_data_ptr<float>();
  return out;
}

}  // namespace leanddp::ops
