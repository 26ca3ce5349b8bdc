#include "quant_table.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace leanddp::ops {
namespace {

// Floats in their order as signed integers (-0.0 and +0.0 both 0), and back.
int64_t ordered(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const int64_t mag = u & 0x7fffffffu;
  return (u >> 31) ? -mag : mag;
}

float from_ordered(int64_t o) {
  const uint32_t u = o < 0 ? (static_cast<uint32_t>(-o) | 0x80000000u) : static_cast<uint32_t>(o);
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

std::unique_ptr<QuantTable> build(const float* q) {
  auto t = std::make_unique<QuantTable>();
  const auto code = [q](float x) { return quantize_code(x, q); };
  // first[k]: the least float in (-2, 2] with code >= k (code(-2) is 0 and code(2) is 255 for
  // any map within [-1, 1]; the search assumes the codes never decrease, checked below).
  const int64_t lo0 = ordered(-2.0f), hi0 = ordered(2.0f);
  if (code(-2.0f) != 0 || code(2.0f) != kQmapSize - 1) return t;  // not exact
  t->first[0] = -std::numeric_limits<float>::infinity();
  for (int k = 1; k < kQmapSize; ++k) {
    int64_t lo = lo0, hi = hi0;  // code(lo) < k <= code(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (code(from_ordered(mid)) >= k ? hi : lo) = mid;
    }
    t->first[k] = from_ordered(hi);
  }
  t->first[kQmapSize] = std::numeric_limits<float>::quiet_NaN();
  // Each bucket: its least and greatest float; its code must be base or base + 1 throughout.
  constexpr uint32_t kInfBits = 0x7f800000u;
  bool exact = true;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (int32_t j = 0; j < QuantTable::kKeys; ++j) {
      const int32_t key = QuantTable::kKeyLow + j;
      const uint32_t low = j == 0 ? 0u : static_cast<uint32_t>(key) << QuantTable::kShift;
      const uint32_t high = key == QuantTable::kKeyHigh
                                ? kInfBits
                                : (static_cast<uint32_t>(key + 1) << QuantTable::kShift) - 1;
      float lo_mag, hi_mag;
      std::memcpy(&lo_mag, &low, sizeof(float));
      std::memcpy(&hi_mag, &high, sizeof(float));
      const float least = sign ? -hi_mag : lo_mag;
      const float greatest = sign ? -lo_mag : hi_mag;
      const int base = code(least);
      const int top = code(greatest);
      exact = exact && top >= base && top <= base + 1;
      t->base[QuantTable::bucket(low, sign)] = static_cast<uint8_t>(base);
    }
  }
  // The codes never decrease: each breakpoint is above the last.
  for (int k = 2; k < kQmapSize; ++k) exact = exact && t->first[k] > t->first[k - 1];
  t->exact = exact;
  return t;
}

}  // namespace

const QuantTable& quant_table(const float* qmap) {
  static std::mutex mu;
  static std::vector<std::pair<std::array<float, kQmapSize>, std::unique_ptr<QuantTable>>> cache;
  std::array<float, kQmapSize> key;
  std::memcpy(key.data(), qmap, sizeof(float) * kQmapSize);
  const std::lock_guard<std::mutex> lock(mu);
  for (const auto& [map, table] : cache) {
    if (std::memcmp(map.data(), key.data(), sizeof(float) * kQmapSize) == 0) return *table;
  }
  cache.emplace_back(key, build(qmap));
  return *cache.back().second;
}

}  // namespace leanddp::ops
