#include "op_calls.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace leanddp {

void flatten_into(at::TensorList tensors, const at::Tensor& out, std::optional<double> scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("leanddp::flatten_into", "")
                       .typed<void(at::TensorList, const at::Tensor&, std::optional<double>)>();
  op.call(tensors, out, scale);
}

void unflatten_from(const at::Tensor& flat, at::TensorList tensors) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("leanddp::unflatten_from", "")
                       .typed<void(const at::Tensor&, at::TensorList, std::optional<double>)>();
  op.call(flat, tensors, std::nullopt);
}

}  // namespace leanddp
