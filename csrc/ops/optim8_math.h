// The per-element arithmetic of block-wise 8-bit Adam and AdamW (torchao's Adam8bit and
// AdamW8bit), shared by the CPU and CUDA kernels.
//
// State: each moment is stored as one uint8 code per element and one float32 scale per block of
// `block` consecutive elements (in the parameter's memory order); its value is qmap[code] * scale,
// with torchao's signed map for exp_avg and its unsigned map for exp_avg_sq (256 sorted float32
// entries each, taken from the state, never recomputed here). Parameters too small or not a
// multiple of the block keep plain moments in the parameter's dtype and the same update.
//
// The update is torchao's single_param_adam in its order of operations, all in float32 without
// fused multiply-adds (its CPU code is compiled that way): AdamW p -= (lr * wd) * p (Adam:
// g += wd * p); m = lerp(m, g, 1 - beta1), v = lerp(v, g * g, 1 - beta2) in torch's lerp forms;
// p -= lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), with the new float32 moments; then each
// block's moments are requantized: scale = max(|x|) clamped to 1e-12, code = the nearest entry of
// qmap to x / scale by torchao's branchless binary search, ties rounded up. The bias corrections
// bc = 1 - beta^step are float32, as torchao computes them from its float32 step tensor.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace leanddp::ops {

// The largest block the kernels take (the CPU kernel keeps a block's moments in per-thread
// buffers, the CUDA kernel one block per quantization block).
constexpr int64_t kMaxQuantBlock = 4096;
constexpr int kQmapSize = 256;
constexpr float kMinScale = 1e-12f;  // torchao: scale.clip(1e-12)

// 1/d for a division by a constant d without a division (cpu_loops_8bit.h's ExactDivisor):
// y = RN(1/d), and hi + lo = 1/d to 2^-46 relative, hi = RD(1/d), lo >= 0.
struct Reciprocal {
  float d = 1.0f;  // the divisor these are of
  float y = 1.0f, hi = 1.0f, lo = 0.0f;
};

// d's Reciprocal, for d in (0, 1] (else 1's).
inline Reciprocal reciprocal_of(float d) {
  Reciprocal r;
  if (!(d > 0.0f && d <= 1.0f)) return r;
  r.d = d;
  r.y = 1.0f / d;
  r.hi = r.y;
  // exact: d y has 48 bits, and is within 2^-23 of 1 (Sterbenz's lemma for the subtraction)
  double rest = 1.0 - static_cast<double>(d) * r.y;
  if (rest < 0) {
    r.hi = std::nextafter(r.y, 0.0f);
    rest = 1.0 - static_cast<double>(d) * r.hi;
  }
  r.lo = static_cast<float>(rest / d);
  return r;
}

struct Adam8Consts {
  float grad_mul;  // clipping's scale (1 if none)
  float lr;
  float lr_wd;     // lr * weight_decay in float32 (AdamW)
  float l2;        // weight_decay (Adam)
  float coef1;     // lerp coefficient of the first moment: w (base: start) or -(1 - w) (base: end)
  bool end_base1;  // |1 - beta1| >= 0.5: lerp's base is its end
  float coef2;     // the same for the second moment
  bool end_base2;
  float bc1;       // 1 - beta1^step (float32)
  float bc2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  bool decoupled;                    // AdamW (else Adam's L2 term)
  Reciprocal inv_bc1, inv_bc2_sqrt;  // (the CPU kernel's)
};

inline Adam8Consts make_adam8_consts(double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step, bool decoupled,
                                     std::optional<double> grad_scale) {
  Adam8Consts c{};
  c.grad_mul = static_cast<float>(grad_scale.value_or(1.0));
  c.lr = static_cast<float>(lr);  // torchao keeps lr as a float32 tensor
  c.lr_wd = decoupled ? c.lr * static_cast<float>(weight_decay) : 0.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  // torch's lerp with a Python float weight w (inductor's lowering): coefficient w, or
  // -(1 - w), computed in double (-(1 - w) and w - 1 differ in the sign of a zero, at w = 1)
  const double w1 = 1.0 - beta1, w2 = 1.0 - beta2;
  c.end_base1 = std::abs(w1) >= 0.5;
  c.coef1 = static_cast<float>(c.end_base1 ? -(1.0 - w1) : w1);
  c.end_base2 = std::abs(w2) >= 0.5;
  c.coef2 = static_cast<float>(c.end_base2 ? -(1.0 - w2) : w2);
  const auto s = static_cast<float>(step);
  c.bc1 = 1.0f - std::pow(static_cast<float>(beta1), s);
  c.bc2_sqrt = std::sqrt(1.0f - std::pow(static_cast<float>(beta2), s));
  c.eps = static_cast<float>(eps);
  c.decoupled = decoupled;
  c.inv_bc1 = reciprocal_of(c.bc1);
  c.inv_bc2_sqrt = reciprocal_of(c.bc2_sqrt);
  return c;
}

// One element: p updated in place from gradient g and the moments' old values m, v; their new
// values in m_new, v_new (to be requantized, or stored as they are for plain state).
// kDecoupled: AdamW.
template <bool kDecoupled>
C10_HOST_DEVICE C10_ALWAYS_INLINE void adam8_update(float& p, float g, float m, float v,
                                                    float& m_new, float& v_new,
                                                    const Adam8Consts& c) {
  g = g * c.grad_mul;  // (exact for 1)
  if constexpr (kDecoupled) {
    p = p - c.lr_wd * p;
  } else {
    g = g + c.l2 * p;
  }
  // torch's lerp decomposition: coef * (end - start) + base
  m_new = c.coef1 * (g - m) + (c.end_base1 ? g : m);
  const float g2 = g * g;
  v_new = c.coef2 * (g2 - v) + (c.end_base2 ? g2 : v);
  const float denom = sqrtf(v_new) / c.bc2_sqrt + c.eps;
  p = p - c.lr * (m_new / c.bc1) / denom;
}

// The block's scale from the largest magnitude of its new moment (from_bits of the maximum of
// abs_bits).
C10_HOST_DEVICE C10_ALWAYS_INLINE float quant_scale(float absmax) {
  return absmax < kMinScale ? kMinScale : absmax;
}

// The bits of |x|, and back: for non-negative floats the integer order is the float order, and a
// NaN's bits exceed every number's, so a block's largest magnitude is an integer maximum that a
// NaN wins, as torch's amax lets it (and an integer maximum vectorizes without fast math).
C10_HOST_DEVICE C10_ALWAYS_INLINE uint32_t abs_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x) & 0x7fffffffu;
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u & 0x7fffffffu;
#endif
}

C10_HOST_DEVICE C10_ALWAYS_INLINE float from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// The code of xn = x / scale: torchao's branchless binary search (the largest i >= 1 with
// qmap[i] <= xn, else 0), then up to the next entry if xn is at least half way to it.
C10_HOST_DEVICE C10_ALWAYS_INLINE int quantize_code(float xn, const float* qmap) {
  int c = xn >= qmap[128] ? 128 : 0;
  c += xn >= qmap[c + 64] ? 64 : 0;
  c += xn >= qmap[c + 32] ? 32 : 0;
  c += xn >= qmap[c + 16] ? 16 : 0;
  c += xn >= qmap[c + 8] ? 8 : 0;
  c += xn >= qmap[c + 4] ? 4 : 0;
  c += xn >= qmap[c + 2] ? 2 : 0;
  c += xn >= qmap[c + 1] ? 1 : 0;
  const int up = c + 1 < kQmapSize ? c + 1 : kQmapSize - 1;
  const float lo = qmap[c], hi = qmap[up];
  return xn - lo >= (hi - lo) * 0.5f ? up : c;
}

}  // namespace leanddp::ops
