// Inner loops of the block-wise 8-bit Adam(W) CPU kernel (optim8_cpu.cpp), included by
// cpu_loops.h inside each instruction set's namespace (no include guard, on purpose). The
// arithmetic is optim8_math.h's. A block is stepped in passes over its moments held as floats
// in scratch buffers (in L1): dequantize, update, the largest magnitudes (an integer maximum,
// abs_bits), requantize. The update, the maxima and the quantization's divisions and bucket
// keys are vectorized. The table look-ups (one per element to dequantize, and one to quantize,
// quant_table.h, where its table is exact, else torchao's binary search) are AVX-512 gathers
// where the instruction set has them, scalar loads elsewhere. The compiler turns the scalar
// loops into emulated gathers (element by element through general registers): the step took
// 1.65 times as long that way on an Intel Xeon (benchmarks/results/host_step.md Run 7), and
// about as long as with gathers on an AMD Zen 4 (Run 6, at an earlier stage of the kernel).

// dst[i] = qmap[codes[i]] * scale.
LEANDDP_ISA_ATTR void dequant8(const uint8_t* __restrict codes, const float* __restrict qmap,
                               float scale, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if LEANDDP_ISA_F16C == 512  // AVX-512
  const __m512 vscale = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, qmap, 4), vscale));
  }
#endif
  for (; i < n; ++i) dst[i] = qmap[codes[i]] * scale;
}

#if LEANDDP_ISA_F16C == 512  // AVX-512
// quant8's table path for the first n - n % 16 elements (returned): QuantTable's bucket, one
// gathered entry and its code per element, 16 at a time, as the scalar path computes them.
LEANDDP_ISA_ATTR int64_t quant8_gathered(const float* __restrict x, float scale,
                                         const QuantTable& table, uint8_t* __restrict codes,
                                         int64_t n) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i low_mask = _mm512_set1_epi32(static_cast<int32_t>(QuantTable::kLowMask));
  const __m512i key_low = _mm512_set1_epi32(QuantTable::kKeyLow);
  const __m512i key_high = _mm512_set1_epi32(QuantTable::kKeyHigh);
  const __m512i keys = _mm512_set1_epi32(QuantTable::kKeys);
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
  const __m512i base_mask = _mm512_set1_epi32(0xff);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xn = _mm512_div_ps(_mm512_loadu_ps(x + i), vscale);
    const __m512i u = _mm512_castps_si512(xn);
    const __m512i abs = _mm512_and_si512(u, abs_mask);
    const __mmask16 negative = _mm512_cmplt_epi32_mask(u, zero);  // the sign bit
    // bucket(abs, sign) and within(abs, sign)
    __m512i key = _mm512_srli_epi32(abs, QuantTable::kShift);
    key = _mm512_sub_epi32(_mm512_min_epi32(_mm512_max_epi32(key, key_low), key_high), key_low);
    key = _mm512_mask_add_epi32(key, negative, key, keys);
    const __m512i low = _mm512_and_si512(abs, low_mask);
    const __m512i within = _mm512_mask_sub_epi32(low, negative, zero, low);
    // code(entry, within); a NaN's code is 0
    const __m512i entry = _mm512_i32gather_epi32(key, table.entry, 4);
    __m512i code = _mm512_and_si512(entry, base_mask);
    const __mmask16 up = _mm512_cmpge_epi32_mask(within, _mm512_srai_epi32(entry, 8));
    code = _mm512_mask_add_epi32(code, up, code, one);
    code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(xn, xn, _CMP_ORD_Q), code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(code));
  }
  return i;
}
#endif

// codes[i] = the code of x[i] / scale (quantize_code's); x is scratch, which it may overwrite.
LEANDDP_ISA_ATTR void quant8(float* __restrict x, float scale, const float* __restrict qmap,
                             const QuantTable* table, uint8_t* __restrict codes, int64_t n) {
  if (table == nullptr || !table->exact) {
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<uint8_t>(quantize_code(x[i] / scale, qmap));
    return;
  }
  int64_t done = 0;
#if LEANDDP_ISA_F16C == 512
  done = quant8_gathered(x, scale, *table, codes, n);
#endif
  const int32_t* entries = table->entry;
  constexpr int64_t kStep = 256;
  int32_t keys[kStep], within[kStep], found[kStep];
  for (int64_t at = done; at < n; at += kStep) {
    const int64_t len = n - at < kStep ? n - at : kStep;
    float* xs = x + at;
    for (int64_t i = 0; i < len; ++i) {  // vectorized
      const float xn = xs[i] / scale;
      uint32_t u;
      std::memcpy(&u, &xn, sizeof(u));
      xs[i] = xn;
      keys[i] = QuantTable::bucket(u & 0x7fffffffu, u >> 31);
      within[i] = QuantTable::within(u & 0x7fffffffu, u >> 31);
    }
    for (int64_t i = 0; i < len; ++i) found[i] = entries[keys[i]];  // one table read each
    for (int64_t i = 0; i < len; ++i) {                             // vectorized
      const int c = QuantTable::code(found[i], within[i]);
      codes[at + i] = static_cast<uint8_t>(xs[i] != xs[i] ? 0 : c);
    }
  }
}

#if LEANDDP_ISA_F16C == 512  // AVX-512
// Whether divide_exactly may divide by d: a normal float in (0, 1], as the bias corrections are
// where beta is in [0, 1).
inline bool exact_divisor(float d) { return d >= 0x1p-126f && d <= 1.0f; }

// x / d for every float x, rounded as the float division rounds it, without a division: x
// widened to double, times inv = 1 / d rounded to double, rounded back to float. The product is
// within 2^-52 relative of x / d. The quotient of two floats is never a rounding boundary of
// floats (a midpoint M 2^k, M odd, times d's 24-bit significand is not a float, d in (0, 1]),
// nor closer to one than 2^-49 relative (x - M 2^k d is a nonzero multiple of the product of
// their last places; a subnormal's boundary is closer, but then so is the error): both round to
// the same float, overflow to infinity, zeros' signs and NaNs alike
// (tests/scripts/check_exact_division.cpp compares the two).
LEANDDP_ISA_ATTR C10_ALWAYS_INLINE __m512 divide_exactly(__m512 x, __m512d inv) {
  const __m256 low = _mm512_castps512_ps256(x);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  const __m256 q_low = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(low), inv));
  const __m256 q_high = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(high), inv));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(q_low)),
                                             _mm256_castps_pd(q_high), 1));
}
#endif

// adam8_update over n elements in place: p, and the moments m, v from their old values to their
// new ones. AVX-512 steps 16 lanes at a time with the same operations in the same order, its two
// divisions by the bias corrections as divide_exactly's where it can.
template <bool kDecoupled>
LEANDDP_ISA_ATTR void adam8_update_loop(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const Adam8Consts& consts) {
  const Adam8Consts c = consts;  // (as in adam_loop)
  int64_t i = 0;
#if LEANDDP_ISA_F16C == 512
  // (no division instruction where the bias corrections allow: divide_exactly)
  const bool exact_divisors = exact_divisor(c.bc1) && exact_divisor(c.bc2_sqrt);
  const __m512 grad_mul = _mm512_set1_ps(c.grad_mul), lr = _mm512_set1_ps(c.lr);
  const __m512 lr_wd = _mm512_set1_ps(c.lr_wd), l2 = _mm512_set1_ps(c.l2);
  const __m512 coef1 = _mm512_set1_ps(c.coef1), coef2 = _mm512_set1_ps(c.coef2);
  const __m512 bc1 = _mm512_set1_ps(c.bc1), bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  const __m512d inv_bc1 = _mm512_set1_pd(1.0 / static_cast<double>(c.bc1));
  const __m512d inv_bc2_sqrt = _mm512_set1_pd(1.0 / static_cast<double>(c.bc2_sqrt));
  const __m512 eps = _mm512_set1_ps(c.eps);
  const __mmask16 end1 = c.end_base1 ? 0xffff : 0, end2 = c.end_base2 ? 0xffff : 0;
  for (; i + 16 <= n; i += 16) {
    __m512 pv = _mm512_loadu_ps(p + i);
    __m512 gv = _mm512_mul_ps(_mm512_loadu_ps(g + i), grad_mul);
    if constexpr (kDecoupled) {
      pv = _mm512_sub_ps(pv, _mm512_mul_ps(lr_wd, pv));
    } else {
      gv = _mm512_add_ps(gv, _mm512_mul_ps(l2, pv));
    }
    const __m512 mv = _mm512_loadu_ps(m + i), vv = _mm512_loadu_ps(v + i);
    const __m512 m_new = _mm512_add_ps(_mm512_mul_ps(coef1, _mm512_sub_ps(gv, mv)),
                                       _mm512_mask_blend_ps(end1, mv, gv));
    const __m512 g2 = _mm512_mul_ps(gv, gv);
    const __m512 v_new = _mm512_add_ps(_mm512_mul_ps(coef2, _mm512_sub_ps(g2, vv)),
                                       _mm512_mask_blend_ps(end2, vv, g2));
    const __m512 root = _mm512_sqrt_ps(v_new);
    // sqrt(v_new) / bc2_sqrt, m_new / bc1
    const __m512 root_c =
        exact_divisors ? divide_exactly(root, inv_bc2_sqrt) : _mm512_div_ps(root, bc2_sqrt);
    const __m512 m_c = exact_divisors ? divide_exactly(m_new, inv_bc1) : _mm512_div_ps(m_new, bc1);
    const __m512 denom = _mm512_add_ps(root_c, eps);
    pv = _mm512_sub_ps(pv, _mm512_div_ps(_mm512_mul_ps(lr, m_c), denom));
    _mm512_storeu_ps(p + i, pv);
    _mm512_storeu_ps(m + i, m_new);
    _mm512_storeu_ps(v + i, v_new);
  }
#endif
  for (; i < n; ++i) adam8_update<kDecoupled>(p[i], g[i], m[i], v[i], m[i], v[i], c);
}

// One quantization block of n elements: parameters p (float) stepped in place from gradients g;
// the moments' codes cm, cv and scales *sm, *sv read and rewritten; mbuf, vbuf: n floats of
// scratch for the moments.
template <bool kDecoupled>
LEANDDP_ISA_ATTR void adam8_quant_loop(float* __restrict p, const float* __restrict g,
                                       uint8_t* __restrict cm, uint8_t* __restrict cv,
                                       float* __restrict sm, float* __restrict sv,
                                       const QuantMaps& maps, int64_t n, const Adam8Consts& consts,
                                       float* __restrict mbuf, float* __restrict vbuf) {
  const Adam8Consts c = consts;  // (as in adam_loop)
  dequant8(cm, maps.qs, *sm, mbuf, n);
  dequant8(cv, maps.qu, *sv, vbuf, n);
  adam8_update_loop<kDecoupled>(p, g, mbuf, vbuf, n, c);
  uint32_t bm = 0, bv = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t am = abs_bits(mbuf[i]), av = abs_bits(vbuf[i]);
    bm = am > bm ? am : bm;
    bv = av > bv ? av : bv;
  }
  *sm = quant_scale(from_bits(bm));
  *sv = quant_scale(from_bits(bv));
  quant8(mbuf, *sm, maps.qs, maps.ts, cm, n);
  quant8(vbuf, *sv, maps.qu, maps.tu, cv, n);
}

LEANDDP_ISA_ATTR void adam8_quant_block(float* __restrict p, const float* __restrict g,
                                        uint8_t* __restrict cm, uint8_t* __restrict cv,
                                        float* __restrict sm, float* __restrict sv,
                                        const QuantMaps& maps, int64_t n, const Adam8Consts& c,
                                        float* __restrict mbuf, float* __restrict vbuf) {
  c.decoupled ? adam8_quant_loop<true>(p, g, cm, cv, sm, sv, maps, n, c, mbuf, vbuf)
              : adam8_quant_loop<false>(p, g, cm, cv, sm, sv, maps, n, c, mbuf, vbuf);
}

// n elements of a parameter whose moments m, v are plain floats: the same update.
LEANDDP_ISA_ATTR void adam8_plain_block(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const Adam8Consts& c) {
  c.decoupled ? adam8_update_loop<true>(p, g, m, v, n, c)
              : adam8_update_loop<false>(p, g, m, v, n, c);
}
