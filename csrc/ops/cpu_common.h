// Helpers of the CPU optimizer kernels (optim_cpu.cpp, optim8_cpu.cpp): moving blocks of
// bfloat16/float16 tensors in and out of float buffers, and reading the ops' scalar arguments.
#pragma once

#include "cpu_kernels.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace leanddp::ops {

// n elements of `src` (float, bfloat16 or float16, starting at element `at`) as floats: `src`
// itself when float, else converted into `buf`.
inline float* as_float(at::ScalarType dtype, void* src, int64_t at, int64_t n, float* buf) {
  const auto& loops = cpu_loops();
  if (dtype == at::kFloat) return static_cast<float*>(src) + at;
  if (dtype == at::kBFloat16) {
    loops.bf16_to_float(static_cast<const c10::BFloat16*>(src) + at, buf, n);
  } else {
    loops.half_to_float(static_cast<const c10::Half*>(src) + at, buf, n);
  }
  return buf;
}

// Rounds the n floats of `buf` into `dst` (bfloat16 or float16, from element `at`).
inline void store_low(at::ScalarType dtype, const float* buf, void* dst, int64_t at, int64_t n) {
  const auto& loops = cpu_loops();
  if (dtype == at::kBFloat16) {
    loops.float_to_bf16(buf, static_cast<c10::BFloat16*>(dst) + at, n);
  } else {
    loops.float_to_half(buf, static_cast<c10::Half*>(dst) + at, n);
  }
}

// Element i of tensor t's memory.
template <typename T>
inline T* at_elem(const at::Tensor& t, int64_t i) {
  return static_cast<T*>(const_cast<void*>(t.const_data_ptr())) + i;
}

// Whether GradScaler's found_inf says this step must not happen (torch's fused kernels: return).
inline bool skipped(const std::optional<at::Tensor>& found_inf) {
  return found_inf.has_value() && *found_inf->const_data_ptr<float>() != 0.0f;
}

}  // namespace leanddp::ops
