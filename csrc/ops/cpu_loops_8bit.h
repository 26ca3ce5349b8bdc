// Inner loops of the block-wise 8-bit Adam(W) CPU kernel (optim8_cpu.cpp), included by
// cpu_loops.h inside each instruction set's namespace, and by cpu_kernels.cpp alone for the
// avx512vbmi variant (no include guard, on purpose). The arithmetic is optim8_math.h's. A block
// is stepped in passes over its moments held as floats in scratch buffers (in L1): dequantize;
// update, taking the new moments' largest magnitudes (an integer maximum, abs_bits) as it goes;
// requantize (with AVX-512, a run of blocks overlaps each block's update with the previous
// block's quantization: adam8_quant_overlapped). The update, the maxima and the quantization's
// divisions and bucket keys are vectorized. The table look-ups (one per element to dequantize,
// and one to quantize, quant_table.h, where its table is exact, else torchao's binary search) are
// gathers with AVX-512 (16 lanes) and AVX2 (8), scalar loads in the baseline; where
// LEANDDP_ISA_VBMI is defined (AVX-512 with VBMI) dequantizing is byte permutes instead. The
// compiler turns the scalar loops into emulated gathers (element by element through general
// registers): the step took 1.65 times as long that way with AVX-512 and 1.5 times with AVX2 on
// an Intel Xeon (benchmarks/results/host_step.md Runs 7 and 8), and about as long as with
// gathers on an AMD Zen 4 (Run 6, at an earlier stage of the kernel).

// The loops ask for the memory two blocks ahead of the one they step, a cache line each pass
// (prefetch_line, cpu_kernels.h), where a parameter's next blocks lie (the hardware prefetchers
// stop at each 4 KiB page, four blocks of 256 floats, and the step waited on memory there:
// benchmarks/results/host_step.md Runs 7 and 8); past a tensor's end the hint is merely wasted.

#if defined(LEANDDP_ISA_VBMI)
// dequant8 for the first n - n % 64 elements (returned), without gathers: each of the four bytes
// of qmap[code] is looked up in its byte plane (QuantTable::planes) for 64 codes at once, by two
// 128-entry byte permutes (a code's low 7 bits) and a blend (its top bit), and the four planes'
// bytes are interleaved into floats. The interleaving works within 128-bit lanes, so the codes
// are first permuted (kOrder) such that each float lands in its element's place. The bits equal
// the gathered entry's, so the products do too.
LEANDDP_ISA_ATTR int64_t dequant8_shuffled(const uint8_t* __restrict codes, const QuantTable& table,
                                           float scale, float* __restrict dst, int64_t n) {
  // byte j of the permuted codes: in 128-bit lane l = j / 16, at j % 16 = 4 w + t, the code of
  // element 16 w + 4 l + t (the interleaving below puts it at float 4 l + t of output w)
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
      22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
      56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(kOrder);
  const __m512 vscale = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    prefetch_line(codes, 2 * n + i);
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    const __mmask64 high = _mm512_movepi8_mask(c);  // codes from 128
    __m512i bytes[4];
    for (int k = 0; k < 4; ++k) {
      const auto* plane = reinterpret_cast<const __m512i*>(table.planes[k]);
      const __m512i low_half =
          _mm512_permutex2var_epi8(_mm512_load_si512(plane), c, _mm512_load_si512(plane + 1));
      const __m512i high_half =
          _mm512_permutex2var_epi8(_mm512_load_si512(plane + 2), c, _mm512_load_si512(plane + 3));
      bytes[k] = _mm512_mask_blend_epi8(high, low_half, high_half);
    }
    // bytes 0 and 1, and 2 and 3, into 16-bit halves; then the halves into floats
    const __m512i low01 = _mm512_unpacklo_epi8(bytes[0], bytes[1]);
    const __m512i high01 = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(bytes[2], bytes[3]);
    const __m512i high23 = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
    const __m512i words[4] = {
        _mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
        _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    for (int w = 0; w < 4; ++w) {
      _mm512_storeu_ps(dst + i + 16 * w, _mm512_mul_ps(_mm512_castsi512_ps(words[w]), vscale));
    }
  }
  return i;
}
#endif

// dst[i] = qmap[codes[i]] * scale; `table`, if not null, is qmap's quant_table().
LEANDDP_ISA_ATTR void dequant8(const uint8_t* __restrict codes, const float* __restrict qmap,
                               const QuantTable* table, float scale, float* __restrict dst,
                               int64_t n) {
  int64_t i = 0;
#if defined(LEANDDP_ISA_VBMI)
  if (table != nullptr) i = dequant8_shuffled(codes, *table, scale, dst, n);
#endif
#if LEANDDP_ISA_F16C == 512  // AVX-512
  const __m512 vscale = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    if (i % 64 == 0) prefetch_line(codes, 2 * n + i);
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, qmap, 4), vscale));
  }
#elif LEANDDP_ISA_F16C == 256  // AVX2
  const __m256 vscale = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8) {
    if (i % 64 == 0) prefetch_line(codes, 2 * n + i);
    const __m256i idx =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_i32gather_ps(qmap, idx, 4), vscale));
  }
#endif
  for (; i < n; ++i) dst[i] = qmap[codes[i]] * scale;
}

#if LEANDDP_ISA_F16C == 512  // AVX-512
// quant8's table path, 16 elements at a time: QuantTable's bucket, one gathered entry and its
// code per element, as the scalar path computes them. kBounded: every x / scale is a number in
// [-1, 1] (scale finite, at least every |x|), so no key passes 1.0's and no NaN needs its code 0.
template <bool kBounded>
class Quantizer16 {
 public:
  LEANDDP_ISA_ATTR Quantizer16(float scale, const QuantTable& table)
      : vscale_(_mm512_set1_ps(scale)), entries_(table.entry) {}

  // codes[0, 16) from x[0, 16)
  LEANDDP_ISA_ATTR C10_ALWAYS_INLINE void operator()(const float* __restrict x,
                                                     uint8_t* __restrict codes) const {
    const __m512i zero = _mm512_setzero_si512();
    const __m512 xn = _mm512_div_ps(_mm512_loadu_ps(x), vscale_);
    const __m512i u = _mm512_castps_si512(xn);
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 negative = _mm512_cmplt_epi32_mask(u, zero);  // the sign bit
    // bucket(abs, sign) and within(abs, sign)
    __m512i key = _mm512_srli_epi32(abs, QuantTable::kShift);
    const __m512i key_low = _mm512_set1_epi32(QuantTable::kKeyLow);
    if constexpr (kBounded) {  // key - kKeyLow, or 0 below it (a 16-bit saturating subtraction)
      key = _mm512_subs_epu16(key, key_low);
    } else {
      const __m512i key_high = _mm512_set1_epi32(QuantTable::kKeyHigh);
      key = _mm512_sub_epi32(_mm512_min_epi32(_mm512_max_epi32(key, key_low), key_high), key_low);
    }
    key = _mm512_mask_add_epi32(key, negative, key, _mm512_set1_epi32(QuantTable::kKeys));
    const __m512i low =
        _mm512_and_si512(abs, _mm512_set1_epi32(static_cast<int32_t>(QuantTable::kLowMask)));
    const __m512i within = _mm512_mask_sub_epi32(low, negative, zero, low);
    // code(entry, within): the entry, plus one where within passes its threshold, has the code
    // in its low byte, which the narrowing keeps (a base of 255 has no threshold); a NaN's is 0
    const __m512i entry = _mm512_i32gather_epi32(key, entries_, 4);
    const __mmask16 up = _mm512_cmpge_epi32_mask(within, _mm512_srai_epi32(entry, 8));
    __m512i code = _mm512_mask_add_epi32(entry, up, entry, _mm512_set1_epi32(1));
    if constexpr (!kBounded) {
      code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(xn, xn, _CMP_ORD_Q), code);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(code));
  }

 private:
  __m512 vscale_;
  const int32_t* entries_;
};

// quant8's table path for the first n - n % 16 elements (returned).
template <bool kBounded>
LEANDDP_ISA_ATTR int64_t quant8_gathered(const float* __restrict x, float scale,
                                         const QuantTable& table, uint8_t* __restrict codes,
                                         int64_t n) {
  const Quantizer16<kBounded> quantize(scale, table);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) quantize(x + i, codes + i);
  return i;
}
#elif LEANDDP_ISA_F16C == 256  // AVX2
// The same, 8 at a time (masks as all-ones lanes).
template <bool kBounded>
LEANDDP_ISA_ATTR int64_t quant8_gathered(const float* __restrict x, float scale,
                                         const QuantTable& table, uint8_t* __restrict codes,
                                         int64_t n) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i low_mask = _mm256_set1_epi32(static_cast<int32_t>(QuantTable::kLowMask));
  const __m256i key_low = _mm256_set1_epi32(QuantTable::kKeyLow);
  const __m256i key_high = _mm256_set1_epi32(QuantTable::kKeyHigh);
  const __m256i keys = _mm256_set1_epi32(QuantTable::kKeys);
  const __m256i one = _mm256_set1_epi32(1);
  // each 128-bit half's four low bytes of its dwords into its first four bytes
  const __m256i narrow =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xn = _mm256_div_ps(_mm256_loadu_ps(x + i), vscale);
    const __m256i u = _mm256_castps_si256(xn);
    const __m256i abs = _mm256_and_si256(u, abs_mask);
    const __m256i negative = _mm256_srai_epi32(u, 31);  // all ones where the sign bit is set
    __m256i key = _mm256_srli_epi32(abs, QuantTable::kShift);
    if constexpr (kBounded) {
      key = _mm256_subs_epu16(key, key_low);
    } else {
      key = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(key, key_low), key_high), key_low);
    }
    key = _mm256_add_epi32(key, _mm256_and_si256(negative, keys));
    const __m256i low = _mm256_and_si256(abs, low_mask);
    const __m256i within = _mm256_sub_epi32(_mm256_xor_si256(low, negative), negative);
    // the entry, plus one unless its threshold exceeds within (cmpgt: -1)
    const __m256i entry = _mm256_i32gather_epi32(table.entry, key, 4);
    const __m256i below = _mm256_cmpgt_epi32(_mm256_srai_epi32(entry, 8), within);
    __m256i code = _mm256_add_epi32(entry, _mm256_add_epi32(one, below));
    if constexpr (!kBounded) {
      code = _mm256_and_si256(code, _mm256_castps_si256(_mm256_cmp_ps(xn, xn, _CMP_ORD_Q)));
    }
    const __m256i bytes = _mm256_shuffle_epi8(code, narrow);
    const auto first = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)));
    const auto second = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
    std::memcpy(codes + i, &first, sizeof(first));
    std::memcpy(codes + i + 4, &second, sizeof(second));
  }
  return i;
}
#endif

// codes[i] = the code of x[i] / scale (quantize_code's); x is scratch, which it may overwrite.
// kBounded: as quant8_gathered's.
template <bool kBounded>
LEANDDP_ISA_ATTR void quant8_block(float* __restrict x, float scale, const float* __restrict qmap,
                                   const QuantTable* table, uint8_t* __restrict codes, int64_t n) {
  if (table == nullptr || !table->exact) {
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<uint8_t>(quantize_code(x[i] / scale, qmap));
    return;
  }
  int64_t done = 0;
#if LEANDDP_ISA_F16C  // AVX2 and AVX-512
  done = quant8_gathered<kBounded>(x, scale, *table, codes, n);
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

// quant8_block, bounded or not.
LEANDDP_ISA_ATTR void quant8(float* __restrict x, float scale, bool bounded,
                             const float* __restrict qmap, const QuantTable* table,
                             uint8_t* __restrict codes, int64_t n) {
  bounded ? quant8_block<true>(x, scale, qmap, table, codes, n)
          : quant8_block<false>(x, scale, qmap, table, codes, n);
}

#if LEANDDP_ISA_F16C == 512  // AVX-512
// Division by a constant d in [2^-26, 1] (a bias correction), rounded as the division rounds it,
// in a multiply and three multiply-adds, where x is 0 or |x| is in [2^-96, 2^100]; other lanes
// (NaNs, infinities, the far ends) divide. With d's Reciprocal (y = RN(1/d), hi = RD(1/d), lo >= 0
// the rest, hi + lo = 1/d to 2^-46 relative): x hi + RN(x lo) is within 2^-45 relative of x / d, so
// q0, its rounding, is within one ulp of x / d (x lo may be subnormal: its error is then under
// 2^-150, still below 2^-54 of x / d); then r = x - q0 d is a float, computed exactly by a
// multiply-add (r is a multiple of 2^(e - 47), e the exponent of x, at least 2^-143: x's lower
// bound), and RN(q0 + r y) = RN(x / d) (Markstein's theorem: y within half an ulp of 1/d, q0
// within one ulp of x / d). The upper bounds keep x / d under 2^126. Zeros keep their sign:
// q0 = x, r = +0, q0 - (+0) y = q0. tests/scripts/check_exact_division.cpp compares it with the
// division.
class ExactDivisor {
 public:
  // whether d is in range and r its reciprocal_of
  static bool usable(float d, const Reciprocal& r) {
    return d >= 0x1p-26f && d <= 1.0f && r.d == d;
  }

  // d and its reciprocal_of (optim8_math.h)
  LEANDDP_ISA_ATTR ExactDivisor(float d, const Reciprocal& r)
      : d_(_mm512_set1_ps(d)),
        y_(_mm512_set1_ps(r.y)),
        hi_(_mm512_set1_ps(r.hi)),
        lo_(_mm512_set1_ps(r.lo)) {}

  LEANDDP_ISA_ATTR C10_ALWAYS_INLINE __m512 divide(__m512 x) const {
    const __m512 q0 = _mm512_fmadd_ps(x, hi_, _mm512_mul_ps(x, lo_));
    const __m512 minus_r = _mm512_fmsub_ps(q0, d_, x);  // +0 for x = +-0
    __m512 q = _mm512_fnmadd_ps(minus_r, y_, q0);
    // lanes neither 0 nor in [2^-96, 2^100]: |x|'s bits less 2^-96's, unsigned, past the range
    const __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 other = _mm512_mask_cmpgt_epu32_mask(
        _mm512_test_epi32_mask(abs, abs), _mm512_sub_epi32(abs, _mm512_set1_epi32(kLowBits)),
        _mm512_set1_epi32(kHighBits - kLowBits));
    if (other != 0) q = _mm512_mask_div_ps(q, other, x, d_);
    return q;
  }

 private:
  static constexpr int32_t kLowBits = (127 - 96) << 23, kHighBits = (127 + 100) << 23;
  __m512 d_, y_, hi_, lo_;
};
#endif

#if LEANDDP_ISA_F16C == 512  // AVX-512
// adam8_update for 16 lanes, with the same operations in the same order; its two divisions by
// the bias corrections are ExactDivisor's where it can.
template <bool kDecoupled>
class Adam8Update16 {
 public:
  LEANDDP_ISA_ATTR explicit Adam8Update16(const Adam8Consts& c)
      : exact_(ExactDivisor::usable(c.bc1, c.inv_bc1) &&
               ExactDivisor::usable(c.bc2_sqrt, c.inv_bc2_sqrt)),
        by_bc1_(c.bc1, c.inv_bc1),
        by_bc2_sqrt_(c.bc2_sqrt, c.inv_bc2_sqrt),
        grad_mul_(_mm512_set1_ps(c.grad_mul)),
        lr_(_mm512_set1_ps(c.lr)),
        lr_wd_(_mm512_set1_ps(c.lr_wd)),
        l2_(_mm512_set1_ps(c.l2)),
        coef1_(_mm512_set1_ps(c.coef1)),
        coef2_(_mm512_set1_ps(c.coef2)),
        bc1_(_mm512_set1_ps(c.bc1)),
        bc2_sqrt_(_mm512_set1_ps(c.bc2_sqrt)),
        eps_(_mm512_set1_ps(c.eps)),
        end1_(c.end_base1 ? 0xffff : 0),
        end2_(c.end_base2 ? 0xffff : 0) {}

  // p[0, 16) stepped in place from g, and m, v from their old values to their new ones.
  // kMaxima: the running maxima max_m, max_v take the new moments' abs_bits.
  template <bool kMaxima>
  LEANDDP_ISA_ATTR C10_ALWAYS_INLINE void step(float* __restrict p, const float* __restrict g,
                                               float* __restrict m, float* __restrict v,
                                               __m512i& max_m, __m512i& max_v) const {
    __m512 pv = _mm512_loadu_ps(p);
    __m512 gv = _mm512_mul_ps(_mm512_loadu_ps(g), grad_mul_);
    if constexpr (kDecoupled) {
      pv = _mm512_sub_ps(pv, _mm512_mul_ps(lr_wd_, pv));
    } else {
      gv = _mm512_add_ps(gv, _mm512_mul_ps(l2_, pv));
    }
    const __m512 mv = _mm512_loadu_ps(m), vv = _mm512_loadu_ps(v);
    const __m512 m_new = _mm512_add_ps(_mm512_mul_ps(coef1_, _mm512_sub_ps(gv, mv)),
                                       _mm512_mask_blend_ps(end1_, mv, gv));
    const __m512 g2 = _mm512_mul_ps(gv, gv);
    const __m512 v_new = _mm512_add_ps(_mm512_mul_ps(coef2_, _mm512_sub_ps(g2, vv)),
                                       _mm512_mask_blend_ps(end2_, vv, g2));
    const __m512 root = _mm512_sqrt_ps(v_new);
    // sqrt(v_new) / bc2_sqrt, m_new / bc1
    const __m512 root_c = exact_ ? by_bc2_sqrt_.divide(root) : _mm512_div_ps(root, bc2_sqrt_);
    const __m512 m_c = exact_ ? by_bc1_.divide(m_new) : _mm512_div_ps(m_new, bc1_);
    const __m512 denom = _mm512_add_ps(root_c, eps_);
    pv = _mm512_sub_ps(pv, _mm512_div_ps(_mm512_mul_ps(lr_, m_c), denom));
    _mm512_storeu_ps(p, pv);
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(v, v_new);
    if constexpr (kMaxima) {
      const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
      max_m = _mm512_max_epu32(max_m, _mm512_and_si512(_mm512_castps_si512(m_new), abs_mask));
      max_v = _mm512_max_epu32(max_v, _mm512_and_si512(_mm512_castps_si512(v_new), abs_mask));
    }
  }

 private:
  bool exact_;  // (no division instruction where the bias corrections allow: ExactDivisor)
  ExactDivisor by_bc1_, by_bc2_sqrt_;
  __m512 grad_mul_, lr_, lr_wd_, l2_, coef1_, coef2_, bc1_, bc2_sqrt_, eps_;
  __mmask16 end1_, end2_;
};

// The largest of x's lanes (by hand: GCC 12 warns inside _mm512_reduce_max_epu32).
LEANDDP_ISA_ATTR inline uint32_t largest_lane(__m512i x) {
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, x);
  uint32_t largest = 0;
  for (const uint32_t lane : lanes) largest = std::max(largest, lane);
  return largest;
}

// The loops ask for p's and g's memory two blocks (of n) ahead of element i.
LEANDDP_ISA_ATTR C10_ALWAYS_INLINE void prefetch_ahead(const float* p, const float* g, int64_t n,
                                                       int64_t i) {
  prefetch_line(p, (2 * n + i) * static_cast<int64_t>(sizeof(float)));
  prefetch_line(g, (2 * n + i) * static_cast<int64_t>(sizeof(float)));
}
#endif

// adam8_update over n elements in place: p, and the moments m, v from their old values to their
// new ones (AVX-512: Adam8Update16, 16 lanes at a time). kMaxima: maxima[0] and [1] are set to the
// largest abs_bits of the new m and v.
template <bool kDecoupled, bool kMaxima = false>
LEANDDP_ISA_ATTR void adam8_update_loop(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const Adam8Consts& consts, uint32_t* maxima = nullptr) {
  const Adam8Consts c = consts;  // (as in adam_loop)
  int64_t i = 0;
  uint32_t bm = 0, bv = 0;
#if LEANDDP_ISA_F16C == 512
  const Adam8Update16<kDecoupled> update(c);
  __m512i vbm = _mm512_setzero_si512(), vbv = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(p, g, n, i);
    update.template step<kMaxima>(p + i, g + i, m + i, v + i, vbm, vbv);
  }
  if constexpr (kMaxima) {
    bm = largest_lane(vbm);
    bv = largest_lane(vbv);
  }
#endif
  for (; i < n; ++i) {
    adam8_update<kDecoupled>(p[i], g[i], m[i], v[i], m[i], v[i], c);
    if constexpr (kMaxima) {
      bm = std::max(bm, abs_bits(m[i]));
      bv = std::max(bv, abs_bits(v[i]));
    }
  }
  if constexpr (kMaxima) {
    maxima[0] = bm;
    maxima[1] = bv;
  }
}

// a finite largest magnitude bounds every x / scale by 1
constexpr uint32_t kInfBits = 0x7f800000u;

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
  dequant8(cm, maps.qs, maps.ts, *sm, mbuf, n);
  dequant8(cv, maps.qu, maps.tu, *sv, vbuf, n);
  uint32_t maxima[2];
  adam8_update_loop<kDecoupled, true>(p, g, mbuf, vbuf, n, c, maxima);
  *sm = quant_scale(from_bits(maxima[0]));
  *sv = quant_scale(from_bits(maxima[1]));
  quant8(mbuf, *sm, maxima[0] < kInfBits, maps.qs, maps.ts, cm, n);
  quant8(vbuf, *sv, maxima[1] < kInfBits, maps.qu, maps.tu, cv, n);
}

#if LEANDDP_ISA_F16C == 512  // AVX-512
// adam8_quant_loop over `blocks` consecutive blocks of n elements (n a multiple of 16, both maps'
// tables exact), with block b's update and block b - 1's quantization in one loop: the
// quantization waits on the divider and the gathers, the update mostly on the vector arithmetic,
// and in one loop they overlap (in separate loops, the out-of-order window is too small to).
// mbuf, vbuf: 2 n floats each, block b's moments in half b % 2.
template <bool kDecoupled>
LEANDDP_ISA_ATTR void adam8_quant_overlapped(float* __restrict p, const float* __restrict g,
                                             uint8_t* __restrict cm, uint8_t* __restrict cv,
                                             float* __restrict sm, float* __restrict sv,
                                             const QuantMaps& maps, int64_t n, int64_t blocks,
                                             const Adam8Consts& consts, float* __restrict mbuf,
                                             float* __restrict vbuf) {
  const Adam8Consts c = consts;  // (as in adam_loop)
  const Adam8Update16<kDecoupled> update(c);
  uint32_t last[2] = {0, 0};  // block b - 1's largest abs_bits of m and v
  for (int64_t b = 0; b <= blocks; ++b) {
    const int64_t at = b * n, before = at - n;
    float* m = mbuf + (b % 2) * n;
    float* v = vbuf + (b % 2) * n;
    float* m_before = mbuf + ((b + 1) % 2) * n;
    float* v_before = vbuf + ((b + 1) % 2) * n;
    // block b - 1 is quantized in block b's loop where both its moments are bounded, else here
    const bool overlap = b > 0 && b < blocks && last[0] < kInfBits && last[1] < kInfBits;
    if (b > 0 && !overlap) {
      quant8(m_before, sm[b - 1], last[0] < kInfBits, maps.qs, maps.ts, cm + before, n);
      quant8(v_before, sv[b - 1], last[1] < kInfBits, maps.qu, maps.tu, cv + before, n);
    }
    if (b == blocks) break;
    dequant8(cm + at, maps.qs, maps.ts, sm[b], m, n);
    dequant8(cv + at, maps.qu, maps.tu, sv[b], v, n);
    float* pb = p + at;
    const float* gb = g + at;
    __m512i max_m = _mm512_setzero_si512(), max_v = _mm512_setzero_si512();
    if (overlap) {
      const Quantizer16<true> quantize_m(sm[b - 1], *maps.ts), quantize_v(sv[b - 1], *maps.tu);
      for (int64_t i = 0; i < n; i += 16) {
        prefetch_ahead(pb, gb, n, i);
        update.template step<true>(pb + i, gb + i, m + i, v + i, max_m, max_v);
        quantize_m(m_before + i, cm + before + i);
        quantize_v(v_before + i, cv + before + i);
      }
    } else {
      for (int64_t i = 0; i < n; i += 16) {
        prefetch_ahead(pb, gb, n, i);
        update.template step<true>(pb + i, gb + i, m + i, v + i, max_m, max_v);
      }
    }
    last[0] = largest_lane(max_m);
    last[1] = largest_lane(max_v);
    sm[b] = quant_scale(from_bits(last[0]));
    sv[b] = quant_scale(from_bits(last[1]));
  }
}
#endif

// `blocks` consecutive quantization blocks of n elements each (p, g, cm, cv at the first block's
// first element, sm, sv at its scales), each as adam8_quant_loop steps it; mbuf, vbuf: 2 n floats
// of scratch each where blocks > 1, else n.
LEANDDP_ISA_ATTR void adam8_quant_block(float* __restrict p, const float* __restrict g,
                                        uint8_t* __restrict cm, uint8_t* __restrict cv,
                                        float* __restrict sm, float* __restrict sv,
                                        const QuantMaps& maps, int64_t n, int64_t blocks,
                                        const Adam8Consts& c, float* __restrict mbuf,
                                        float* __restrict vbuf) {
#if LEANDDP_ISA_F16C == 512
  const bool tables = maps.ts != nullptr && maps.ts->exact && maps.tu != nullptr && maps.tu->exact;
  if (blocks > 1 && n % 16 == 0 && tables) {
    c.decoupled
        ? adam8_quant_overlapped<true>(p, g, cm, cv, sm, sv, maps, n, blocks, c, mbuf, vbuf)
        : adam8_quant_overlapped<false>(p, g, cm, cv, sm, sv, maps, n, blocks, c, mbuf, vbuf);
    return;
  }
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * n;
    c.decoupled ? adam8_quant_loop<true>(p + at, g + at, cm + at, cv + at, sm + b, sv + b, maps, n,
                                         c, mbuf, vbuf)
                : adam8_quant_loop<false>(p + at, g + at, cm + at, cv + at, sm + b, sv + b, maps, n,
                                          c, mbuf, vbuf);
  }
}

// n elements of a parameter whose moments m, v are plain floats: the same update.
LEANDDP_ISA_ATTR void adam8_plain_block(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const Adam8Consts& c) {
  c.decoupled ? adam8_update_loop<true>(p, g, m, v, n, c)
              : adam8_update_loop<false>(p, g, m, v, n, c);
}
