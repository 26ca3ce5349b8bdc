// The fp16 loops of an instruction set with F16C (AVX2, AVX-512), included by cpu_loops.h inside
// its namespace (no include guard, on purpose; LEANDDP_ISA_F16C: the vector width in bits).
//
// c10::Half's portable conversion branches per element and does not vectorize; F16C's packed
// converts do, with the same results (exact widening; rounding to nearest even). The optimizer
// loops take one pass over fp16 parameters, gradients and state, without the float buffers of
// the other dtypes: kLanes elements at a time are widened into small arrays the compiler keeps
// in registers, updated by the same per-element code (vectorized across the lanes) and rounded
// back. (bf16 keeps the buffered path: c10::BFloat16's conversions vectorize in a loop over a
// block, not across a few lanes.)

#if LEANDDP_ISA_F16C == 512
constexpr int64_t kLanes = 16;
LEANDDP_ISA_ATTR inline void widen(const c10::Half* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
LEANDDP_ISA_ATTR inline void narrow(const float* src, c10::Half* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm512_cvtps_ph(_mm512_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
}
#else
constexpr int64_t kLanes = 8;
LEANDDP_ISA_ATTR inline void widen(const c10::Half* src, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}
LEANDDP_ISA_ATTR inline void narrow(const float* src, c10::Half* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
}
#endif

template <>
LEANDDP_ISA_ATTR void convert_block<c10::Half, float>(const c10::Half* __restrict src,
                                                      float* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) widen(src + i, dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
LEANDDP_ISA_ATTR void convert_block<float, c10::Half>(const float* __restrict src,
                                                      c10::Half* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) narrow(src + i, dst + i);
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// scale_block's arithmetic (scaled in float, rounded once); src may equal dst.
LEANDDP_ISA_ATTR void scale_half_block(const c10::Half* src, c10::Half* dst, int64_t n,
                                       double scale) {
  const float s = static_cast<float>(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    alignas(64) float x[kLanes];
    widen(src + i, x);
    for (int64_t k = 0; k < kLanes; ++k) x[k] *= s;
    narrow(x, dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(static_cast<float>(src[i]) * s);
}

// adam_loop over fp16, in one pass.
template <bool kL2, bool kLerpSmall, bool kAmp>
LEANDDP_ISA_ATTR void adam_half_loop(c10::Half* __restrict p, const c10::Half* __restrict g,
                                     c10::Half* __restrict m, c10::Half* __restrict v, int64_t n,
                                     int64_t tail, const AdamConsts& consts) {
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
  for (; i < n; ++i) {  // (fewer than kLanes before the tail, then the tail)
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

template <bool kL2, bool kLerpSmall>
LEANDDP_ISA_ATTR void adam_half_amp(c10::Half* p, const c10::Half* g, c10::Half* m, c10::Half* v,
                                    int64_t n, int64_t tail, const AdamConsts& c) {
  c.amp_scale != 1.0f ? adam_half_loop<kL2, kLerpSmall, true>(p, g, m, v, n, tail, c)
                      : adam_half_loop<kL2, kLerpSmall, false>(p, g, m, v, n, tail, c);
}

LEANDDP_ISA_ATTR void adam_half_block(c10::Half* p, const c10::Half* g, c10::Half* m, c10::Half* v,
                                      int64_t n, int64_t tail, const AdamConsts& c) {
  if (c.use_l2) {
    c.lerp_small ? adam_half_amp<true, true>(p, g, m, v, n, tail, c)
                 : adam_half_amp<true, false>(p, g, m, v, n, tail, c);
  } else {
    c.lerp_small ? adam_half_amp<false, true>(p, g, m, v, n, tail, c)
                 : adam_half_amp<false, false>(p, g, m, v, n, tail, c);
  }
}

// sgd_loop over fp16, in one pass.
template <bool kMomentum, bool kAmp>
LEANDDP_ISA_ATTR void sgd_half_loop(c10::Half* __restrict p, const c10::Half* __restrict g,
                                    c10::Half* __restrict buf, int64_t n, const SgdConsts& consts) {
  const SgdConsts c = consts;  // (as in adam_loop)
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    alignas(64) float pf[kLanes], gf[kLanes], bf[kLanes];
    widen(p + i, pf);
    widen(g + i, gf);
    if constexpr (kMomentum) widen(buf + i, bf);
#pragma omp simd  // (left to itself GCC unrolls these lanes into scalar code on AVX2)
    for (int64_t k = 0; k < kLanes; ++k)
      sgd_update<LEANDDP_ISA_FMA, kMomentum, kAmp>(pf[k], gf[k], bf + k, c);
    narrow(pf, p + i);
    if constexpr (kMomentum) narrow(bf, buf + i);
  }
  for (; i < n; ++i) {
    float pf = p[i], bf = kMomentum ? static_cast<float>(buf[i]) : 0.0f;
    sgd_update<LEANDDP_ISA_FMA, kMomentum, kAmp>(pf, g[i], &bf, c);
    p[i] = pf;
    if constexpr (kMomentum) buf[i] = bf;
  }
}

// buf == nullptr: SGD without momentum.
LEANDDP_ISA_ATTR void sgd_half_block(c10::Half* p, const c10::Half* g, c10::Half* buf, int64_t n,
                                     const SgdConsts& c) {
  const bool amp = c.amp_scale != 1.0f;
  if (buf == nullptr) {
    amp ? sgd_half_loop<false, true>(p, g, buf, n, c)
        : sgd_half_loop<false, false>(p, g, buf, n, c);
  } else {
    amp ? sgd_half_loop<true, true>(p, g, buf, n, c) : sgd_half_loop<true, false>(p, g, buf, n, c);
  }
}
