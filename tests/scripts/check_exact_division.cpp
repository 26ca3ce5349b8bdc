// Checks ExactDivisor (csrc/ops/cpu_loops_8bit.h, AVX-512), the 8-bit Adam update's division
// by a bias correction without a division instruction, against that division, bit for bit:
// for every float x in [1, 2), and a stride over all other floats (both signs, zeros,
// subnormals, the largest, infinities, NaNs, the ends of its range), for each divisor d.
// Divisors: 1 - beta^step and its square root (what the kernel divides by) for eight betas over
// steps 1..STEPS, then RANDOM floats in [1/2, 1) (any significand) and RANDOM in [2^-26, 1/2)
// (any exponent too).
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

using leanddp::ops::check::ExactDivisor;

// How many of the 16 floats x0, x0 + 1, ... (as bits) divide differently.
LEANDDP_ISA_ATTR int differ(uint32_t x0, __m512 d, const ExactDivisor& by) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 x =
      _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(x0)), lanes));
  const __m512i quotient = _mm512_castps_si512(_mm512_div_ps(x, d));
  return __builtin_popcount(_mm512_cmpneq_epi32_mask(quotient, _mm512_castps_si512(by.divide(x))));
}

LEANDDP_ISA_ATTR long mismatches(float d) {
  const __m512 vd = _mm512_set1_ps(d);
  const ExactDivisor inv(d, leanddp::ops::reciprocal_of(d));  // (usable: checked by the caller)
  long bad = 0;
  for (uint32_t m = 0; m < (1u << 23); m += 16) bad += differ(0x3f800000u + m, vd, inv);
  for (uint64_t bits = 0; bits + 16 <= (1ull << 32); bits += 16 * 4099) {
    bad += differ(static_cast<uint32_t>(bits), vd, inv);
  }
  // around -0, the subnormals' end, 2^-96 and 2^100 (the range's ends), the largest floats, the
  // infinities and NaNs (quiet and signaling), both signs
  for (const uint32_t edge :
       {0x80000000u, 0x007ffff8u, 0x807ffff8u, 0x0f7ffff8u, 0x8f7ffff8u, 0x717ffff8u, 0xf17ffff8u,
        0x7f7ffff8u, 0xff7ffff8u, 0x7fbffff8u, 0xffbffff8u, 0xfffffff0u}) {
    bad += differ(edge, vd, inv);
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
    const uint32_t bits = 0x3f000000u | (rng() & 0x7fffffu);
    float d;
    std::memcpy(&d, &bits, sizeof(d));
    divisors.push_back(d);
    const uint32_t exponent = (127 - 26) + rng() % 25;  // [2^-26, 2^-2]
    const uint32_t small = (exponent << 23) | (rng() & 0x7fffffu);
    std::memcpy(&d, &small, sizeof(d));
    divisors.push_back(d);
  }
  long total = 0, checked = 0;
  for (const float d : divisors) {
    if (!ExactDivisor::usable(d, leanddp::ops::reciprocal_of(d))) continue;
    const long bad = mismatches(d);
    if (bad != 0) std::printf("divisor %a: %ld mismatches\n", d, bad);
    total += bad;
    ++checked;
  }
  std::printf("%ld divisors, %ld mismatches\n", checked, total);
  return total == 0 ? 0 : 1;
}
