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
    for (int64_t i = 0; i < n; ++i) sgd_update<false, kAmp>(p[i], g[i], nullptr, c);
  } else {
    for (int64_t i = 0; i < n; ++i) sgd_update<true, kAmp>(p[i], g[i], buf + i, c);
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
// fp16: c10::Half's portable conversion branches per element and does not vectorize; F16C's
// packed converts do, with the same results (exact widening; rounding to nearest even).
#if LEANDDP_ISA_F16C == 512
constexpr int64_t kHalfLanes = 16;
#define LEANDDP_LOAD_PH(p) _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
#define LEANDDP_STORE_PH(p, x) \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
#define LEANDDP_LOAD_PS _mm512_loadu_ps
#define LEANDDP_STORE_PS _mm512_storeu_ps
#else
constexpr int64_t kHalfLanes = 8;
#define LEANDDP_LOAD_PH(p) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define LEANDDP_STORE_PH(p, x) \
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT))
#define LEANDDP_LOAD_PS _mm256_loadu_ps
#define LEANDDP_STORE_PS _mm256_storeu_ps
#endif

template <>
LEANDDP_ISA_ATTR void convert_block<c10::Half, float>(const c10::Half* __restrict src,
                                                      float* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + kHalfLanes <= n; i += kHalfLanes) LEANDDP_STORE_PS(dst + i, LEANDDP_LOAD_PH(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
LEANDDP_ISA_ATTR void convert_block<float, c10::Half>(const float* __restrict src,
                                                      c10::Half* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + kHalfLanes <= n; i += kHalfLanes) LEANDDP_STORE_PH(dst + i, LEANDDP_LOAD_PS(src + i));
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}
// Scaled in float, rounded once (scale_block's arithmetic).
LEANDDP_ISA_ATTR void scale_half_block(const c10::Half* src, c10::Half* dst, int64_t n,
                                       double scale) {
  const float s = static_cast<float>(scale);
  int64_t i = 0;
  for (; i + kHalfLanes <= n; i += kHalfLanes) {
    alignas(64) float x[kHalfLanes];
    LEANDDP_STORE_PS(x, LEANDDP_LOAD_PH(src + i));
    for (int64_t k = 0; k < kHalfLanes; ++k) x[k] *= s;
    LEANDDP_STORE_PH(dst + i, LEANDDP_LOAD_PS(x));
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(static_cast<float>(src[i]) * s);
}

#endif

// One pass over fp16 parameters, gradients and state, without float buffers: kLanes elements
// at a time are widened into small arrays the compiler keeps in registers, updated by the same
// per-element code (vectorized across the lanes) and rounded back. (bf16 keeps the buffered
// path: c10::BFloat16's conversions vectorize in a loop over a block, not across a few lanes.)
#if LEANDDP_ISA_F16C
constexpr int64_t kLanes = kHalfLanes;

LEANDDP_ISA_ATTR inline void widen(const c10::Half* src, float* dst) {
  LEANDDP_STORE_PS(dst, LEANDDP_LOAD_PH(src));
}

LEANDDP_ISA_ATTR inline void narrow(const float* src, c10::Half* dst) {
  LEANDDP_STORE_PH(dst, LEANDDP_LOAD_PS(src));
}
#undef LEANDDP_LOAD_PH
#undef LEANDDP_STORE_PH
#undef LEANDDP_LOAD_PS
#undef LEANDDP_STORE_PS

// Adam(W) in one pass over T; elements from `tail` on take torch's tail arithmetic, as in
// adam_loop.
template <typename T, bool kL2, bool kLerpSmall, bool kAmp>
LEANDDP_ISA_ATTR void adam_low_loop(T* __restrict p, const T* __restrict g, T* __restrict m,
                                    T* __restrict v, int64_t n, int64_t tail,
                                    const AdamConsts& consts) {
  const AdamConsts c = consts;  // (as in adam_loop)
  int64_t i = 0;
  for (; i + kLanes <= tail; i += kLanes) {
    alignas(64) float pf[kLanes], gf[kLanes], mf[kLanes], vf[kLanes];
    widen(p + i, pf);
    widen(g + i, gf);
    widen(m + i, mf);
    widen(v + i, vf);
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) {
      adam_update<LEANDDP_ISA_FMA, kL2, kLerpSmall, kAmp>(pf[k], gf[k], mf[k], vf[k], c);
    }
    narrow(pf, p + i);
    narrow(mf, m + i);
    narrow(vf, v + i);
  }
  for (; i < n; ++i) {
    float pf = p[i], mf = m[i], vf = v[i];
    if (i < tail) {
      adam_update<LEANDDP_ISA_FMA, kL2, kLerpSmall, kAmp>(pf, g[i], mf, vf, c);
    } else {
      adam_update<LEANDDP_ISA_FMA, kL2, kLerpSmall, kAmp, /*kTail=*/true>(pf, g[i], mf, vf, c);
    }
    p[i] = pf;
    m[i] = mf;
    v[i] = vf;
  }
}

template <typename T, bool kL2, bool kLerpSmall>
LEANDDP_ISA_ATTR void adam_low_amp(T* p, const T* g, T* m, T* v, int64_t n, int64_t tail,
                                   const AdamConsts& c) {
  c.amp_scale != 1.0f ? adam_low_loop<T, kL2, kLerpSmall, true>(p, g, m, v, n, tail, c)
                      : adam_low_loop<T, kL2, kLerpSmall, false>(p, g, m, v, n, tail, c);
}

template <typename T>
LEANDDP_ISA_ATTR void adam_low_block(T* p, const T* g, T* m, T* v, int64_t n, int64_t tail,
                                     const AdamConsts& c) {
  if (c.use_l2) {
    c.lerp_small ? adam_low_amp<T, true, true>(p, g, m, v, n, tail, c)
                 : adam_low_amp<T, true, false>(p, g, m, v, n, tail, c);
  } else {
    c.lerp_small ? adam_low_amp<T, false, true>(p, g, m, v, n, tail, c)
                 : adam_low_amp<T, false, false>(p, g, m, v, n, tail, c);
  }
}

template <typename T, bool kMomentum, bool kAmp>
LEANDDP_ISA_ATTR void sgd_low_loop(T* __restrict p, const T* __restrict g, T* __restrict buf,
                                   int64_t n, const SgdConsts& consts) {
  const SgdConsts c = consts;  // (as in adam_loop)
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    alignas(64) float pf[kLanes], gf[kLanes], bf[kLanes];
    widen(p + i, pf);
    widen(g + i, gf);
    if constexpr (kMomentum) widen(buf + i, bf);
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) sgd_update<kMomentum, kAmp>(pf[k], gf[k], bf + k, c);
    narrow(pf, p + i);
    if constexpr (kMomentum) narrow(bf, buf + i);
  }
  for (; i < n; ++i) {
    float pf = p[i], bf = kMomentum ? static_cast<float>(buf[i]) : 0.0f;
    sgd_update<kMomentum, kAmp>(pf, g[i], &bf, c);
    p[i] = pf;
    if constexpr (kMomentum) buf[i] = bf;
  }
}

// buf == nullptr: SGD without momentum.
template <typename T>
LEANDDP_ISA_ATTR void sgd_low_block(T* p, const T* g, T* buf, int64_t n, const SgdConsts& c) {
  const bool amp = c.amp_scale != 1.0f;
  if (buf == nullptr) {
    amp ? sgd_low_loop<T, false, true>(p, g, buf, n, c)
        : sgd_low_loop<T, false, false>(p, g, buf, n, c);
  } else {
    amp ? sgd_low_loop<T, true, true>(p, g, buf, n, c)
        : sgd_low_loop<T, true, false>(p, g, buf, n, c);
  }
}
#endif

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
#if LEANDDP_ISA_F16C
  l.scale_half = &scale_half_block;
  l.adam_half = &adam_low_block<c10::Half>;
  l.sgd_half = &sgd_low_block<c10::Half>;
#endif
  return l;
}
