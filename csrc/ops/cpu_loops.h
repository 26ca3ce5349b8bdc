// Inner loops of the CPU kernels, written once and compiled once per instruction set.
//
// cpu_kernels.cpp includes this file several times, each time inside its own namespace and with
// LEANDDP_ISA_ATTR set to that instruction set's function attribute (empty for the baseline), so
// the compiler vectorizes the same source for SSE2, AVX2 and AVX-512; the widest one the CPU
// supports is picked once at load time. No include guard, on purpose. Every loop takes
// __restrict pointers: callers pass non-overlapping ranges (the ops check this).

LEANDDP_ISA_ATTR void adam_block(float* __restrict p, const float* __restrict g,
                                 float* __restrict m, float* __restrict v, int64_t n,
                                 const AdamConsts& c) {
  for (int64_t i = 0; i < n; ++i) adam_update(p[i], g[i], m[i], v[i], c);
}

LEANDDP_ISA_ATTR void sgd_block(float* __restrict p, const float* __restrict g,
                                float* __restrict buf, int64_t n, const SgdConsts& c) {
  if (buf == nullptr) {
    for (int64_t i = 0; i < n; ++i) sgd_update<false>(p[i], g[i], nullptr, c);
  } else {
    for (int64_t i = 0; i < n; ++i) sgd_update<true>(p[i], g[i], buf + i, c);
  }
}

template <typename From, typename To>
LEANDDP_ISA_ATTR void convert_block(const From* __restrict src, To* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<To>(static_cast<float>(src[i]));
}

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
  return l;
}
