// Instantiates cpu_loops.h once per instruction set and picks the widest the CPU supports.
#include "cpu_kernels.h"

#include <ATen/OpMathType.h>

namespace leanddp::ops {

namespace isa_baseline {
#define LEANDDP_ISA_ATTR
#include "cpu_loops.h"
#undef LEANDDP_ISA_ATTR
}  // namespace isa_baseline

#if defined(LEANDDP_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__))
namespace isa_avx2 {
#define LEANDDP_ISA_ATTR __attribute__((target("avx2,fma,f16c")))
#include "cpu_loops.h"
#undef LEANDDP_ISA_ATTR
}  // namespace isa_avx2

namespace isa_avx512 {
#define LEANDDP_ISA_ATTR \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")))
#include "cpu_loops.h"
#undef LEANDDP_ISA_ATTR
}  // namespace isa_avx512
#endif

namespace {

CpuLoops select_loops() {
#if defined(LEANDDP_X86_DISPATCH) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return isa_avx512::make_loops("avx512");
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return isa_avx2::make_loops("avx2");
  }
#endif
  return isa_baseline::make_loops("baseline");
}

}  // namespace

const CpuLoops& cpu_loops() {
  static const CpuLoops loops = select_loops();
  return loops;
}

}  // namespace leanddp::ops
