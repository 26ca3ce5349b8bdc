// Look-up tables that let the vectorized CPU kernels quantize against a 256-entry map in two
// table reads instead of torchao's eight-step binary search, with the same codes.
//
// quantize_code (optim8_math.h) is a non-decreasing step function of its float argument, so it
// is described by its breakpoints: `first[k]`, the least float whose code is at least k. The
// floats in [-1, 1] are cut into buckets by the bits of their magnitude (sign, exponent and the
// top kMantissaBits bits of the mantissa; magnitudes below 2^-kMinExponent share one bucket,
// those from 1 up share another): `base[bucket]` is the code of the bucket's least float. When
// no bucket holds more than one breakpoint, the code of x is base + (x >= first[base + 1]),
// where first[256] is a NaN that no x reaches; a NaN x has code 0 (the search's comparisons all
// fail). The tables are built from quantize_code itself and checked bucket by bucket when
// built; a map they cannot describe this way (`exact` false) keeps the binary search.
#pragma once

#include "optim8_math.h"

#include <cstdint>

namespace leanddp::ops {

struct QuantTable {
  static constexpr int kMantissaBits = 8;
  static constexpr int kMinExponent = 30;
  static constexpr int kShift = 23 - kMantissaBits;  // key = |bits| >> kShift
  static constexpr int32_t kKeyLow = (127 - kMinExponent) << kMantissaBits;  // 2^-30's key
  static constexpr int32_t kKeyHigh = 127 << kMantissaBits;                  // 1.0's key
  static constexpr int32_t kKeys = kKeyHigh - kKeyLow + 1;                   // per sign

  bool exact = false;
  float first[kQmapSize + 1];
  // base codes: [0, kKeys) for x >= +0, [kKeys, 2 * kKeys) for x <= -0; 4 bytes of padding for
  // 32-bit gathers at byte offsets.
  uint8_t base[2 * kKeys + 4];

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
