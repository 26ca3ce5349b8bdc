// Checks divide_exactly (csrc/ops/cpu_loops_8bit.h, AVX-512), the 8-bit Adam update's division
// by a bias correction without a division instruction, against that division: for every float
// x in [1, 2) and each divisor d, both give the same bits. Scaling x by a power of two scales
// both results alike where divide_exactly takes the lanes (magnitudes in [2^-60, 2^100]), so
// [1, 2) stands for every such x. Divisors: 1 - beta^step and its square root (what the kernel
// divides by) for eight betas over steps 1..STEPS, then RANDOM floats in [1, 2) (its bits for
// any divisor's significand).
//
//   g++ -O2 -std=c++17 -I csrc/ops $(torch's include flags) check_exact_division.cpp
//   ./a.out [STEPS=3000] [RANDOM=3000]
//
// Prints the divisors checked and the mismatches; exits 1 if any. Needs a CPU with AVX-512
// (tests/ops/test_exact_division.py builds and runs it with few divisors).
#include <immintrin.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpu_kernels.h"

#define LEANDDP_ISA_ATTR \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")))
#define LEANDDP_ISA_F16C 512
namespace leanddp::ops::check {
#include "cpu_loops_8bit.h"
}  // namespace leanddp::ops::check

namespace {

using leanddp::ops::check::divide_exactly;
using leanddp::ops::check::exact_divisor;

// The floats of [1, 2) whose bits differ between x / d and divide_exactly.
LEANDDP_ISA_ATTR long mismatches(float d) {
  const __m512 vd = _mm512_set1_ps(d), y = _mm512_set1_ps(1.0f / d);
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  long bad = 0;
  for (uint32_t m = 0; m < (1u << 23); m += 16) {
    const __m512 x =
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(0x3f800000 + m), lanes));
    __m512 q;
    if (!divide_exactly(x, vd, y, &q)) return 1 << 23;  // (never, for x in [1, 2))
    const __mmask16 differ =
        _mm512_cmpneq_epi32_mask(_mm512_castps_si512(_mm512_div_ps(x, vd)), _mm512_castps_si512(q));
    bad += __builtin_popcount(differ);
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 3000;
  const int random = argc > 2 ? std::atoi(argv[2]) : 3000;
  std::vector<float> divisors;
  for (const float beta : {0.9f, 0.95f, 0.99f, 0.999f, 0.5f, 0.8f, 0.98f, 0.9999f}) {
    for (int step = 1; step <= steps; ++step) {
      const float correction = 1.0f - std::pow(beta, static_cast<float>(step));
      divisors.push_back(correction);
      divisors.push_back(std::sqrt(correction));
    }
  }
  std::mt19937 rng(3);
  for (int i = 0; i < random; ++i) {
    const uint32_t bits = 0x3f800000u | (rng() & 0x7fffffu);
    float d;
    std::memcpy(&d, &bits, sizeof(d));
    divisors.push_back(d);
  }
  long total = 0, checked = 0;
  for (const float d : divisors) {
    if (!exact_divisor(d)) continue;
    const long bad = mismatches(d);
    if (bad != 0) std::printf("divisor %a: %ld mismatches\n", d, bad);
    total += bad;
    ++checked;
  }
  std::printf("%ld divisors, %ld mismatches\n", checked, total);
  return total == 0 ? 0 : 1;
}
