// Inner loops of the CPU kernels, written once and compiled once per instruction set.
//
// cpu_kernels.cpp includes this file several times, each time inside its own namespace and with
// LEANDDP_ISA_ATTR set to that instruction set's function attribute (empty for the baseline) and
// LEANDDP_ISA_FMA to whether it has fused multiply-add (optim_math.h's kFma) and LEANDDP_ISA_F16C
// to the width of its fp16 conversions (0: none, 256 or 512 bits), so
// the compiler vectorizes the same source for SSE2, AVX2 and AVX-512; the widest one the CPU
// supports is picked once at load time. No include guard, on purpose. Every loop takes
// __restrict pointers: callers pass non-overlapping ranges (the ops check this).

// The constants are copied first: read through the reference, they could alias the float
// arrays the loop writes, and the compiler would reload them every element and not vectorize.
// Elements from `tail` on take torch's tail arithmetic (optim_math.h), a few at most.
template <bool kL2, bool kLerpSmall, bool kAmp>
LEANDDP_ISA_ATTR void adam_loop(float* __restrict p, const float* __restrict g, float* __restrict m,
                                float* __restrict v, int64_t n, int64_t tail,
                                const AdamConsts& consts) {
  const AdamConsts c = consts;
  for (int64_t i = 0; i < tail; ++i) {
    adam_update<LEANDDP_ISA_FMA, kL2, kLerpSmall, kAmp>(p[i], g[i], m[i], v[i], c);
  }
  for (int64_t i = tail; i < n; ++i) {
    adam_update<LEANDDP_ISA_FMA, kL2, kLerpSmall, kAmp, /*kTail=*/true>(p[i], g[i], m[i], v[i], c);
  }
}

// adam_loop<...> for c's forms, picked once per block.
template <bool kL2, bool kLerpSmall>
LEANDDP_ISA_ATTR void adam_amp(float* __restrict p, const float* __restrict g, float* __restrict m,
                               float* __restrict v, int64_t n, int64_t tail, const AdamConsts& c) {
  c.amp_scale != 1.0f ? adam_loop<kL2, kLerpSmall, true>(p, g, m, v, n, tail, c)
                      : adam_loop<kL2, kLerpSmall, false>(p, g, m, v, n, tail, c);
}

LEANDDP_ISA_ATTR void adam_block(float* __restrict p, const float* __restrict g,
                                 float* __restrict m, float* __restrict v, int64_t n, int64_t tail,
                                 const AdamConsts& c) {
  if (c.use_l2) {
    c.lerp_small ? adam_amp<true, true>(p, g, m, v, n, tail, c)
                 : adam_amp<true, false>(p, g, m, v, n, tail, c);
  } else {
    c.lerp_small ? adam_amp<false, true>(p, g, m, v, n, tail, c)
                 : adam_amp<false, false>(p, g, m, v, n, tail, c);
  }
}

template <bool kAmp>
LEANDDP_ISA_ATTR void sgd_loop(float* __restrict p, const float* __restrict g,
                               float* __restrict buf, int64_t n, const SgdConsts& consts) {
  const SgdConsts c = consts;  // (as in adam_loop)
  if (buf == nullptr) {
    for (int64_t i = 0; i < n; ++i)
      sgd_update<LEANDDP_ISA_FMA, false, kAmp>(p[i], g[i], nullptr, c);
  } else {
    for (int64_t i = 0; i < n; ++i) sgd_update<LEANDDP_ISA_FMA, true, kAmp>(p[i], g[i], buf + i, c);
  }
}

LEANDDP_ISA_ATTR void sgd_block(float* __restrict p, const float* __restrict g,
                                float* __restrict buf, int64_t n, const SgdConsts& c) {
  c.amp_scale != 1.0f ? sgd_loop<true>(p, g, buf, n, c) : sgd_loop<false>(p, g, buf, n, c);
}

template <typename From, typename To>
LEANDDP_ISA_ATTR void convert_block(const From* __restrict src, To* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<To>(static_cast<float>(src[i]));
}

#if LEANDDP_ISA_F16C
#include "cpu_loops_f16.h"
#endif

#include "cpu_loops_8bit.h"

template <typename T>
LEANDDP_ISA_ATTR void scale_block(const T* src, T* dst, int64_t n, double scale) {
  // src == dst is allowed (in-place scaling of a tensor that is its own flat slice).
  using opmath_t = at::opmath_type<T>;
  const auto s = static_cast<opmath_t>(scale);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<opmath_t>(src[i]) * s);
}

// The table of this instruction set's loops.
inline CpuLoops make_loops(const char* name) {
  CpuLoops l;
  l.name = name;
  l.adam = &adam_block;
  l.sgd = &sgd_block;
  l.bf16_to_float = &convert_block<c10::BFloat16, float>;
  l.half_to_float = &convert_block<c10::Half, float>;
  l.float_to_bf16 = &convert_block<float, c10::BFloat16>;
  l.float_to_half = &convert_block<float, c10::Half>;
  l.scale_float = &scale_block<float>;
  l.scale_double = &scale_block<double>;
  l.scale_bf16 = &scale_block<c10::BFloat16>;
  l.scale_half = &scale_block<c10::Half>;
  l.adam8_quant = &adam8_quant_block;
  l.adam8_plain = &adam8_plain_block;
  l.adam8_prefetches = LEANDDP_ISA_F16C == 512;
  l.quant8 = &quant8;
  l.dequant8 = &dequant8;
#if LEANDDP_ISA_F16C
  l.scale_half = &scale_half_block;
  l.adam_half = &adam_half_block;
  l.sgd_half = &sgd_half_block;
#endif
  return l;
}
