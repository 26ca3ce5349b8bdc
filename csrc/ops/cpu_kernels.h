// The vectorized inner loops of the CPU kernels, as a table of function pointers filled with the
// widest instruction set the running CPU supports (chosen once, at load time).
#pragma once

#include "optim8_math.h"
#include "optim_math.h"
#include "quant_table.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace leanddp::ops {

// Asks for the cache line `bytes` past `base` (a hint: any address, computed as an integer; no
// effect where the compiler has none).
inline void prefetch_line(const void* base, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + bytes));
#endif
}

// The maps of 8-bit Adam's moments (host memory) and, where built, their quant_table()s.
struct QuantMaps {
  const float* qs;  // exp_avg's (signed)
  const float* qu;  // exp_avg_sq's (unsigned)
  const QuantTable* ts = nullptr;
  const QuantTable* tu = nullptr;
};

struct CpuLoops {
  const char* name;  // "avx512vbmi", "avx512", "avx2" or "baseline"
  // Elements [tail, n) of the n take torch's tail arithmetic (optim_math.h's kTail).
  void (*adam)(float* p, const float* g, float* m, float* v, int64_t n, int64_t tail,
               const AdamConsts& c);
  // buf == nullptr: SGD without momentum.
  void (*sgd)(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c);
  void (*bf16_to_float)(const c10::BFloat16* src, float* dst, int64_t n);
  void (*half_to_float)(const c10::Half* src, float* dst, int64_t n);
  void (*float_to_bf16)(const float* src, c10::BFloat16* dst, int64_t n);
  void (*float_to_half)(const float* src, c10::Half* dst, int64_t n);
  // dst[i] = src[i] * scale in the dtype's math type; src may equal dst.
  void (*scale_float)(const float* src, float* dst, int64_t n, double scale);
  void (*scale_double)(const double* src, double* dst, int64_t n, double scale);
  void (*scale_bf16)(const c10::BFloat16* src, c10::BFloat16* dst, int64_t n, double scale);
  void (*scale_half)(const c10::Half* src, c10::Half* dst, int64_t n, double scale);
  // 16-bit parameters, gradients and state in one pass, without float buffers; as adam and
  // sgd. fp16 only where the instruction set converts it (null: the buffered path steps it).
  void (*adam_bf16)(c10::BFloat16* p, const c10::BFloat16* g, c10::BFloat16* m, c10::BFloat16* v,
                    int64_t n, int64_t tail, const AdamConsts& c);
  void (*sgd_bf16)(c10::BFloat16* p, const c10::BFloat16* g, c10::BFloat16* buf, int64_t n,
                   const SgdConsts& c);
  void (*adam_half)(c10::Half* p, const c10::Half* g, c10::Half* m, c10::Half* v, int64_t n,
                    int64_t tail, const AdamConsts& c) = nullptr;
  void (*sgd_half)(c10::Half* p, const c10::Half* g, c10::Half* buf, int64_t n,
                   const SgdConsts& c) = nullptr;
  // Block-wise 8-bit Adam(W) (optim8_math.h): `blocks` consecutive quantization blocks of n
  // float parameters and gradients each, their codes and scales updated in place (mbuf, vbuf:
  // 2 n floats of scratch each where blocks > 1, else n) ...
  void (*adam8_quant)(float* p, const float* g, uint8_t* cm, uint8_t* cv, float* sm, float* sv,
                      const QuantMaps& maps, int64_t n, int64_t blocks, const Adam8Consts& c,
                      float* mbuf, float* vbuf);
  // The codes of x[i] / scale (x: scratch, which it may overwrite) through `table` if exact, else
  // the binary search (optim8_math.h's quantize_code either way). bounded: the caller knows every
  // x[i] / scale to be a number in [-1, 1] (a finite scale at least every |x[i]|).
  void (*quant8)(float* x, float scale, bool bounded, const float* qmap, const QuantTable* table,
                 uint8_t* codes, int64_t n);
  // dst[i] = qmap[codes[i]] * scale (table: qmap's quant_table(), or null), as adam8_quant
  // dequantizes.
  void (*dequant8)(const uint8_t* codes, const float* qmap, const QuantTable* table, float scale,
                   float* dst, int64_t n);
  // ... or n elements of a parameter with plain float moments.
  void (*adam8_plain)(float* p, const float* g, float* m, float* v, int64_t n,
                      const Adam8Consts& c);
  // Whether adam8_quant asks for the memory of the parameters and gradients ahead itself
  // (cpu_loops_8bit.h's prefetch_line; AVX-512): elsewhere its caller asks for each block's.
  bool adam8_prefetches = false;
};

// The loops for this CPU.
const CpuLoops& cpu_loops();

// Where the tail of a tensor of `numel` elements of `element_size` bytes starts: torch's fused
// CPU Adam steps whole 32-byte vectors, then the remaining elements in its scalar loop.
inline int64_t adam_tail_start(int64_t numel, int64_t element_size) {
  return numel - numel % (32 / element_size);
}

}  // namespace leanddp::ops
