// Inner loops of the block-wise 8-bit Adam(W) CPU kernel (optim8_cpu.cpp), included by
// cpu_loops.h inside each instruction set's namespace (no include guard, on purpose). The
// arithmetic is optim8_math.h's. A block is stepped in passes over its moments held as floats
// in scratch buffers (in L1): dequantize, update, the largest magnitudes (an integer maximum,
// abs_bits), requantize. The update, the maxima and the quantization's divisions and bucket
// keys are vectorized; the table look-ups are scalar loads (as fast here as AVX2/AVX-512
// gathers, measured on AMD Zen 4): one per element to dequantize, and one to quantize
// (quant_table.h) where its table is exact, else torchao's binary search.

// dst[i] = qmap[codes[i]] * scale.
LEANDDP_ISA_ATTR void dequant8(const uint8_t* __restrict codes, const float* __restrict qmap,
                               float scale, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = qmap[codes[i]] * scale;
}

// codes[i] = the code of x[i] / scale (quantize_code's); x is overwritten (scratch).
LEANDDP_ISA_ATTR void quant8(float* __restrict x, float scale, const float* __restrict qmap,
                             const QuantTable* table, uint8_t* __restrict codes, int64_t n) {
  if (table == nullptr || !table->exact) {
    for (int64_t i = 0; i < n; ++i)
      codes[i] = static_cast<uint8_t>(quantize_code(x[i] / scale, qmap));
    return;
  }
  const int32_t* entries = table->entry;
  constexpr int64_t kStep = 256;
  int32_t keys[kStep], within[kStep], found[kStep];
  for (int64_t at = 0; at < n; at += kStep) {
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
  for (int64_t i = 0; i < n; ++i) {
    adam8_update<kDecoupled>(p[i], g[i], mbuf[i], vbuf[i], mbuf[i], vbuf[i], c);
  }
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
template <bool kDecoupled>
LEANDDP_ISA_ATTR void adam8_plain_loop(float* __restrict p, const float* __restrict g,
                                       float* __restrict m, float* __restrict v, int64_t n,
                                       const Adam8Consts& consts) {
  const Adam8Consts c = consts;
  for (int64_t i = 0; i < n; ++i) {
    float m_new, v_new;
    adam8_update<kDecoupled>(p[i], g[i], m[i], v[i], m_new, v_new, c);
    m[i] = m_new;
    v[i] = v_new;
  }
}

LEANDDP_ISA_ATTR void adam8_plain_block(float* __restrict p, const float* __restrict g,
                                        float* __restrict m, float* __restrict v, int64_t n,
                                        const Adam8Consts& c) {
  c.decoupled ? adam8_plain_loop<true>(p, g, m, v, n, c)
              : adam8_plain_loop<false>(p, g, m, v, n, c);
}
