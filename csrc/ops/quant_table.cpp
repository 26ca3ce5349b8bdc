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
  for (int c = 0; c < kQmapSize; ++c) {
    uint32_t u;
    std::memcpy(&u, &q[c], sizeof(u));
    for (int k = 0; k < 4; ++k) t->planes[k][c] = static_cast<uint8_t>(u >> (8 * k));
  }
  const auto code = [q](float x) { return quantize_code(x, q); };
  // first[k]: the least float in (-2, 2] with code >= k (code(-2) is 0 and code(2) is 255 for
  // any map within [-1, 1]; the search assumes the codes never decrease, checked below).
  const int64_t lo0 = ordered(-2.0f), hi0 = ordered(2.0f);
  // The codes never decrease with x exactly when the map is sorted (no NaN): the checks below
  // prove the table right only then.
  for (int k = 1; k < kQmapSize; ++k) {
    if (!(q[k - 1] < q[k])) return t;  // not exact
  }
  if (code(-2.0f) != 0 || code(2.0f) != kQmapSize - 1) return t;
  std::array<float, kQmapSize + 1> first{};
  for (int k = 1; k < kQmapSize; ++k) {
    int64_t lo = lo0, hi = hi0;  // code(lo) < k <= code(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (code(from_ordered(mid)) >= k ? hi : lo) = mid;
    }
    first[k] = from_ordered(hi);
  }
  bool exact = true;
  for (int k = 2; k < kQmapSize; ++k) exact = exact && first[k] > first[k - 1];
  // What the table gives for x (not a NaN), as the kernels compute it.
  const auto looked_up = [&](float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    const uint32_t abs = u & 0x7fffffffu, sign = u >> 31;
    return QuantTable::code(t->entry[QuantTable::bucket(abs, sign)], QuantTable::within(abs, sign));
  };
  constexpr uint32_t kInfBits = 0x7f800000u;
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
      // the breakpoint to the next code, if it lies in this bucket (the first and last buckets
      // span several exponents: none may lie there)
      const bool inside =
          base + 1 < kQmapSize && first[base + 1] > least && first[base + 1] <= greatest;
      int32_t threshold = sign ? 1 : static_cast<int32_t>(QuantTable::kLowMask) + 1;  // never
      if (inside) {
        const bool spans = j == 0 || key == QuantTable::kKeyHigh;
        exact = exact && !spans;
        uint32_t u;
        std::memcpy(&u, &first[base + 1], sizeof(u));
        threshold = QuantTable::within(u & 0x7fffffffu, sign);
      }
      t->entry[QuantTable::bucket(low, sign)] =
          base | static_cast<int32_t>(static_cast<uint32_t>(threshold) << 8);
      // checked where the code can change: both ends, and both sides of the breakpoint
      exact = exact && looked_up(least) == base && looked_up(greatest) == code(greatest);
      if (inside) {
        const float below = std::nextafter(first[base + 1], -2.0f);
        exact = exact && looked_up(first[base + 1]) == base + 1 && looked_up(below) == code(below);
      }
    }
  }
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
