// Instantiates cpu_loops.h once per instruction set and picks the widest the CPU supports.
#include "cpu_kernels.h"

#include <ATen/OpMathType.h>

#if defined(LEANDDP_X86_DISPATCH)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace leanddp::ops {

// The baseline has FMA where the architecture always does (AArch64) or the build enables it;
// x86-64's does not (torch's DEFAULT capability computes its multiply-adds unfused there too).
#if defined(__aarch64__) || defined(__FMA__)
#define LEANDDP_BASELINE_FMA true
#else
#define LEANDDP_BASELINE_FMA false
#endif

namespace isa_baseline {
#define LEANDDP_ISA_ATTR
#define LEANDDP_ISA_FMA LEANDDP_BASELINE_FMA
#define LEANDDP_ISA_F16C 0
#include "cpu_loops.h"
#undef LEANDDP_ISA_F16C
#undef LEANDDP_ISA_FMA
#undef LEANDDP_ISA_ATTR
}  // namespace isa_baseline

#if defined(LEANDDP_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__))
namespace isa_avx2 {
#define LEANDDP_ISA_ATTR __attribute__((target("avx2,fma,f16c")))
#define LEANDDP_ISA_FMA true
#define LEANDDP_ISA_F16C 256
#include "cpu_loops.h"
#undef LEANDDP_ISA_F16C
#undef LEANDDP_ISA_FMA
#undef LEANDDP_ISA_ATTR
}  // namespace isa_avx2

// GCC 12 warns inside its own AVX-512 conversion intrinsics (their deliberately undefined
// passthrough operand), at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace isa_avx512 {
#if defined(__clang__)
#define LEANDDP_ISA_ATTR __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#else  // GCC would otherwise keep 256-bit vectors for AVX-512 code
#define LEANDDP_ISA_ATTR \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")))
#endif
#define LEANDDP_ISA_FMA true
#define LEANDDP_ISA_F16C 512
#include "cpu_loops.h"
#undef LEANDDP_ISA_F16C
#undef LEANDDP_ISA_FMA
#undef LEANDDP_ISA_ATTR
}  // namespace isa_avx512

// AVX-512 with VBMI's byte permutes (Intel's AVX-512 CPUs from Ice Lake on, AMD Zen 4 and later):
// AVX-512's loops, but for 8-bit Adam's, compiled once more: they dequantize by byte shuffles
// instead of gathers (and the compiler may use VBMI elsewhere in them).
namespace isa_avx512vbmi {
#if defined(__clang__)
#define LEANDDP_ISA_ATTR \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")))
#else
#define LEANDDP_ISA_ATTR                                           \
  __attribute__((                                                  \
      target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c," \
             "prefer-vector-width=512")))
#endif
#define LEANDDP_ISA_FMA true
#define LEANDDP_ISA_F16C 512
#define LEANDDP_ISA_VBMI
#include "cpu_loops_8bit.h"
#undef LEANDDP_ISA_VBMI
#undef LEANDDP_ISA_F16C
#undef LEANDDP_ISA_FMA
#undef LEANDDP_ISA_ATTR

CpuLoops make_loops(const char* name) {
  CpuLoops l = isa_avx512::make_loops(name);
  l.adam8_quant = &adam8_quant_block;
  l.adam8_plain = &adam8_plain_block;
  l.quant8 = &quant8;
  l.dequant8 = &dequant8;
  return l;
}
}  // namespace isa_avx512vbmi
#pragma GCC diagnostic pop
#endif

namespace {

// The widest instruction set the CPU supports; or the one LEANDDP_CPU_ISA names (baseline, avx2,
// avx512, avx512vbmi), if the CPU supports it: for tests, and for ruling out a vectorization issue.
CpuLoops select_loops() {
  std::vector<CpuLoops> supported{isa_baseline::make_loops("baseline")};  // narrowest first
#if defined(LEANDDP_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2) supported.push_back(isa_avx2::make_loops("avx2"));
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    supported.push_back(isa_avx512::make_loops("avx512"));
    if (__builtin_cpu_supports("avx512vbmi")) {
      supported.push_back(isa_avx512vbmi::make_loops("avx512vbmi"));
    }
  }
#endif
  const char* want = std::getenv("LEANDDP_CPU_ISA");
  for (const auto& loops : supported) {
    if (want != nullptr && std::strcmp(want, loops.name) == 0) return loops;
  }
  return supported.back();
}

}  // namespace

const CpuLoops& cpu_loops() {
  static const CpuLoops loops = select_loops();
  return loops;
}

}  // namespace leanddp::ops
