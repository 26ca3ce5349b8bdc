// The per-element arithmetic of the fused optimizers, shared by the CPU and CUDA kernels.
//
// Hyper-parameters are reduced once per call, in double, to the float constants the update
// needs (the learning rate, Adam's step counts and GradScaler's scale may instead be read from
// tensors by the kernel itself: apply_scalars(), the same code on both backends), rounded as
// torch's fused kernels round them.
// The element updates apply the same operations in the same order as torch's fused CPU Adam(W)
// and torch.optim.SGD (including the multiply-adds torch's CPU build fuses, written here as
// explicit fmaf), so float32, bfloat16 and float16 Adam(W) are bitwise equal to torch's fused CPU
// kernel and float32 SGD to torch's for-loop SGD in practice. Both backends compile this without
// any other FMA contraction (-ffp-contract=off, nvcc --fmad=false), with IEEE sqrt and division, so
// the CPU kernels of instruction sets with FMA and the CUDA kernels give bit-identical results.
// An instruction set without FMA (x86-64's baseline) takes kFma = false: each multiply-add is a
// multiply then an add, as torch's own kernel computes it there (its DEFAULT capability), and the
// loop still vectorizes (a software fmaf would not).
//
// The update is a template on what the loop must not branch on (the weight decay's form, the
// lerp's form), so a CPU loop over it has no control flow and vectorizes.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace leanddp::ops {

// Adam and AdamW. `decoupled` selects AdamW (param *= 1 - lr * weight_decay) over Adam's L2
// term (grad += weight_decay * param).
struct AdamConsts {
  float grad_mul;     // grad_scale (1 if none), negated when maximizing
  float amp_scale;    // GradScaler's scale the gradients are divided by (1 if none)
  float decay_mul;    // 1 - lr * weight_decay for AdamW, else 1
  float l2;           // weight_decay for Adam
  bool use_l2;        // Adam with weight_decay != 0
  float lerp_w;       // 1 - beta1: torch's lerp weight for the first moment
  float lerp_w_comp;  // 1 - lerp_w, in float, as torch's lerp computes it
  bool lerp_small;    // lerp_w < 0.5: torch's lerp takes its start + w * (end - start) form
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
  // Kept to derive the lr-dependent constants from a learning rate read later (set_lr).
  double lr;                // the call's learning rate (a float lr; an lr tensor replaces it)
  double bc1;               // 1 - beta1^step
  double beta1_d, beta2_d;  // beta1, beta2 (for set_step)
  double weight_decay;
  bool decoupled;
};

// The constants that depend on the learning rate, in double as torch computes them.
C10_HOST_DEVICE inline void set_lr(AdamConsts& c, double lr) {
  c.lr = lr;
  c.decay_mul = c.decoupled ? static_cast<float>(1.0 - lr * c.weight_decay) : 1.0f;
  c.neg_step_size = static_cast<float>(-(lr / c.bc1));
}

// The constants that depend on the step count (1-based) and the learning rate.
C10_HOST_DEVICE inline void set_step(AdamConsts& c, double step, double lr) {
  c.bc1 = 1.0 - pow(c.beta1_d, step);
  c.bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(c.beta2_d, step)));
  set_lr(c, lr);
}

// The optional scalars of one call, as tensors the kernel reads itself (null: absent): where
// they live is the backend's business (host memory for the CPU kernels, device memory for the
// CUDA ones); what they change is decided here, once, for both.
struct ScalarPtrs {
  const float* lr_f = nullptr;       // the learning rate, float32 ...
  const double* lr_d = nullptr;      // ... or float64
  const float* amp_scale = nullptr;  // GradScaler's scale
};

// The learning rate a call steps with: its lr tensor if it has one, else its float lr.
C10_HOST_DEVICE inline double lr_of(const ScalarPtrs& s, double float_lr) {
  return s.lr_f ? static_cast<double>(*s.lr_f) : s.lr_d ? *s.lr_d : float_lr;
}

// Applies a call's scalars to the constants of one tensor: its step count (`step`, Adam's per
// tensor count of this update, or null: the call's `step` argument) and the call's lr tensor
// and amp scale. `c` comes from make_adam_consts with the call's float lr, which stays in force
// unless an lr tensor replaces it.
C10_HOST_DEVICE inline void apply_scalars(AdamConsts& c, const ScalarPtrs& s, const float* step) {
  const double lr = lr_of(s, c.lr);
  if (step != nullptr) {
    set_step(c, static_cast<double>(*step), lr);
  } else if (s.lr_f || s.lr_d) {
    set_lr(c, lr);
  }
  if (s.amp_scale) c.amp_scale = *s.amp_scale;
}

inline AdamConsts make_adam_consts(double lr, double beta1, double beta2, double eps,
                                   double weight_decay, int64_t step, bool decoupled, bool maximize,
                                   std::optional<double> grad_scale) {
  AdamConsts c{};
  c.grad_mul = static_cast<float>(grad_scale.value_or(1.0)) * (maximize ? -1.0f : 1.0f);
  c.amp_scale = 1.0f;
  c.weight_decay = weight_decay;
  c.decoupled = decoupled;
  c.beta1_d = beta1;
  c.beta2_d = beta2;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  c.use_l2 = !decoupled && weight_decay != 0.0;
  c.lerp_w = static_cast<float>(1.0 - beta1);
  c.lerp_w_comp = 1.0f - c.lerp_w;
  c.lerp_small = c.lerp_w < 0.5f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  set_step(c, static_cast<double>(step), lr);
  return c;
}

// Always inlined, here and below: an out-of-line copy would be compiled for the baseline
// instruction set (this header carries no target attribute), where fmaf is a library call and
// nothing vectorizes; inlined, each copy takes its caller's instruction set (cpu_loops.h).
// a * b + c: one fused multiply-add (kFma), or a multiply then an add.
template <bool kFma>
C10_HOST_DEVICE C10_ALWAYS_INLINE float madd(float a, float b, float c) {
  if constexpr (kFma) {
    return fmaf(a, b, c);
  } else {
    return a * b + c;  // (not contracted: -ffp-contract=off)
  }
}

// One element: p, m, v updated in place from gradient g. kL2: Adam with weight decay
// (c.use_l2); kLerpSmall: c.lerp_small; kAmp: a GradScaler scale other than 1 to divide by
// (dividing by 1 is exact: skipped, as torch's kernels skip it without a scale). kTail: the last
// numel % 8 elements of a float tensor
// (% 16 of a 16-bit one), which torch's CPU kernel steps in a scalar loop where its build fuses
// the second moment's other product (measured against torch's DEFAULT, AVX2 and AVX-512 kernels:
// tests/ops/test_cpu_isa.py).
template <bool kFma, bool kL2, bool kLerpSmall, bool kAmp = true, bool kTail = false>
C10_HOST_DEVICE C10_ALWAYS_INLINE void adam_update(float& p, float g, float& m, float& v,
                                                   const AdamConsts& c) {
  g = g * c.grad_mul;                             // maximize, and clipping's scale (exact for 1)
  if constexpr (kAmp) g /= c.amp_scale;           // torch's fused kernels: grad / grad_scale
  if constexpr (kL2) g = madd<kFma>(p, c.l2, g);  // torch: grad.add(param, alpha=weight_decay)
  p = p * c.decay_mul;                            // torch: param.mul_(1 - lr * weight_decay)
  // torch: exp_avg.lerp_(grad, 1 - beta1) in both of lerp's forms, each one multiply-add as
  // torch's vectorized CPU lerp and fused Adam compute it (fmaf: the same bits on CUDA).
  const float diff = g - m;
  if constexpr (kLerpSmall) {
    m = madd<kFma>(c.lerp_w, diff, m);
  } else {
    m = madd<kFma>(-c.lerp_w_comp, diff, g);
  }
  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2), with the multiply-add torch's CPU build
  // fuses it into
  if constexpr (kTail) {
    v = madd<kFma>(v, c.beta2, c.one_minus_beta2 * g * g);
  } else {
    v = madd<kFma>(c.one_minus_beta2 * g, g, v * c.beta2);
  }
  const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;  // (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
  p = p + c.neg_step_size * m / denom;  // torch's fused Adam: param - step_size * exp_avg / denom
}

// adam_update for the forms `c` holds, chosen per element: for a GPU thread, whose branch is
// uniform; a CPU loop picks the instance once instead (cpu_loops.h).
template <bool kFma>
C10_HOST_DEVICE inline void adam_update_any(float& p, float g, float& m, float& v,
                                            const AdamConsts& c) {
  if (c.use_l2) {
    c.lerp_small ? adam_update<kFma, true, true>(p, g, m, v, c)
                 : adam_update<kFma, true, false>(p, g, m, v, c);
  } else {
    c.lerp_small ? adam_update<kFma, false, true>(p, g, m, v, c)
                 : adam_update<kFma, false, false>(p, g, m, v, c);
  }
}

// SGD with optional momentum, dampening, Nesterov and L2 weight decay.
struct SgdConsts {
  float grad_mul;   // grad_scale (1 if none), negated when maximizing
  float amp_scale;  // GradScaler's scale the gradients are divided by (1 if none)
  float weight_decay;
  bool use_weight_decay;
  float momentum;
  float one_minus_dampening;
  bool first_step;  // the momentum buffer holds no history: it is set to the gradient
  bool nesterov;
  float neg_lr;
};

C10_HOST_DEVICE inline void set_lr(SgdConsts& c, double lr) { c.neg_lr = static_cast<float>(-lr); }

// SGD's counterpart of apply_scalars (SGD has no step count).
C10_HOST_DEVICE inline void apply_scalars(SgdConsts& c, const ScalarPtrs& s) {
  if (s.lr_f || s.lr_d) set_lr(c, lr_of(s, 0.0));
  if (s.amp_scale) c.amp_scale = *s.amp_scale;
}

inline SgdConsts make_sgd_consts(double lr, double momentum, double dampening, bool nesterov,
                                 double weight_decay, bool maximize, bool first_step,
                                 std::optional<double> grad_scale) {
  SgdConsts c{};
  c.grad_mul = static_cast<float>(grad_scale.value_or(1.0)) * (maximize ? -1.0f : 1.0f);
  c.amp_scale = 1.0f;
  c.weight_decay = static_cast<float>(weight_decay);
  c.use_weight_decay = weight_decay != 0.0;
  c.momentum = static_cast<float>(momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - dampening);
  c.first_step = first_step;
  c.nesterov = nesterov;
  set_lr(c, lr);
  return c;
}

// One element; `buf` is the momentum buffer element, only touched when kMomentum. kFma and kAmp
// as in adam_update. Each of torch's `add(x, alpha=a)` is one multiply-add, as its CPU kernel
// computes it (vectorized: fmadd; its DEFAULT capability: a multiply then an add), so float32
// results equal torch.optim.SGD's for-loop and foreach steps bit for bit on the CPU (torch's
// fused CPU SGD equals them too but for a few last bits of each tensor's tail:
// tests/ops/test_cpu_isa.py).
template <bool kFma, bool kMomentum, bool kAmp = true>
C10_HOST_DEVICE C10_ALWAYS_INLINE void sgd_update(float& p, float g, float* buf,
                                                  const SgdConsts& c) {
  g = g * c.grad_mul;
  if constexpr (kAmp) g /= c.amp_scale;
  // torch: d_p.add(param, alpha=weight_decay)
  g = c.use_weight_decay ? madd<kFma>(p, c.weight_decay, g) : g;
  if constexpr (kMomentum) {
    // torch: buf = clone(d_p) on the first step, else buf.mul_(momentum).add_(d_p, 1-dampening)
    const float b = c.first_step ? g : madd<kFma>(g, c.one_minus_dampening, *buf * c.momentum);
    *buf = b;
    g = c.nesterov ? madd<kFma>(b, c.momentum, g) : b;  // torch: d_p.add(buf, alpha=momentum)
  }
  p = madd<kFma>(g, c.neg_lr, p);  // torch: param.add_(d_p, alpha=-lr)
}

}  // namespace leanddp::ops
