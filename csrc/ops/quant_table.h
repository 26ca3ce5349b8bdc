// Look-up tables that let the vectorized CPU kernels quantize against a 256-entry map in two
// table reads instead of torchao's eight-step binary search, with the same codes; and the map
// itself cut into byte planes, for dequantizing by byte shuffles.
//
// quantize_code (optim8_math.h) is a non-decreasing step function of its float argument, so it
// is described by its breakpoints: `first[k]`, the least float whose code is at least k. The
// floats in [-1, 1] are cut into buckets by the bits of their magnitude (sign, exponent and the
// top kMantissaBits bits of the mantissa; magnitudes below 2^-kMinExponent share one bucket,
// those from 1 up share another). Inside a bucket every float has the same sign and top bits,
// so its order is that of its low kLowBits bits (reversed for negative floats): when no bucket
// holds more than one breakpoint, the code of x is its bucket's base code (that of the bucket's
// least float), plus one if x is at or past the bucket's breakpoint, a comparison of low bits.
// Each bucket's base and breakpoint are one 32-bit entry, so a code costs one table read. A NaN
// x has code 0 (the search's comparisons all fail). The table is built from quantize_code
// itself and checked bucket by bucket, at both ends and on both sides of its breakpoint; a map
// it cannot describe this way (`exact` false) keeps the binary search.
#pragma once

#include "optim8_math.h"

#include <cstdint>

namespace leanddp::ops {

struct QuantTable {
  static constexpr int kMantissaBits = 8;
  static constexpr int kMinExponent = 30;
  static constexpr int kShift = 23 - kMantissaBits;         // key = |bits| >> kShift
  static constexpr uint32_t kLowMask = (1u << kShift) - 1;  // the bits within a bucket
  static constexpr int32_t kKeyLow = (127 - kMinExponent) << kMantissaBits;  // 2^-30's key
  static constexpr int32_t kKeyHigh = 127 << kMantissaBits;                  // 1.0's key
  static constexpr int32_t kKeys = kKeyHigh - kKeyLow + 1;                   // per sign

  bool exact = false;
  // The map's entries cut into bytes: planes[k][c] is byte k (from the least significant) of
  // qmap[c]'s bits. Set for every map, exact or not.
  alignas(64) uint8_t planes[4][kQmapSize];
  // per bucket ([0, kKeys) for x >= +0, [kKeys, 2 * kKeys) for x <= -0): the base code in bits
  // 0-7, and above them (entry >> 8, signed) the threshold t of within(x) that moves x up one code
  int32_t entry[2 * kKeys];

  // x's value within its bucket, increasing with x: its low bits, negated for a negative x.
  C10_ALWAYS_INLINE static int32_t within(uint32_t abs, uint32_t sign) {
    const auto low = static_cast<int32_t>(abs & kLowMask);
    return sign ? -low : low;
  }
  // The code of x (not a NaN) from its bucket's entry.
  C10_ALWAYS_INLINE static int code(int32_t entry, int32_t within) {
    return (entry & 0xff) + (within >= (entry >> 8) ? 1 : 0);
  }

  // The bucket of x whose magnitude's bits are `abs` and sign bit `sign` (0 or 1).
  C10_ALWAYS_INLINE static int32_t bucket(uint32_t abs, uint32_t sign) {
    int32_t key = static_cast<int32_t>(abs >> kShift);
    key = key < kKeyLow ? kKeyLow : key > kKeyHigh ? kKeyHigh : key;
    return key - kKeyLow + static_cast<int32_t>(sign) * kKeys;
  }
};

// The tables of `qmap` (256 sorted float32 entries, host memory), built once per distinct map
// and kept for the process (torchao's maps are two). Thread-safe.
const QuantTable& quant_table(const float* qmap);

}  // namespace leanddp::ops
