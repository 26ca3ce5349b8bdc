// The custom ops as C++ calls, through the dispatcher so that CPU and CUDA tensors take the same
// path (the kernels and their checks are in ops/; the schemas in ops/schemas.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace leanddp {

// leanddp::flatten_into: `tensors` into consecutive slices of the 1-D `out`, times `scale`.
void flatten_into(at::TensorList tensors, const at::Tensor& out, std::optional<double> scale);
// leanddp::unflatten_from: consecutive slices of the 1-D `flat` into `tensors`, in place.
void unflatten_from(const at::Tensor& flat, at::TensorList tensors);

}  // namespace leanddp
