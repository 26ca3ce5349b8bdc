#include "flat_common.h"

#include <ATen/ops/empty.h>

namespace leanddp::ops {

bool is_flat_slice(const at::Tensor& t, const at::Tensor& flat, int64_t offset) {
  const auto* base = static_cast<const char*>(flat.const_data_ptr());
  return t.const_data_ptr() == base + offset * flat.element_size() &&
         t.is_non_overlapping_and_dense();
}

at::Tensor contiguous_stand_in(const at::Tensor& t, const at::Tensor& flat, int64_t offset,
                               bool to_flat, bool scaled, PendingCopies& pending) {
  auto slice = flat.narrow(0, offset, t.numel()).view(t.sizes());
  if (to_flat) {
    slice.copy_(t);
    return scaled ? slice : at::Tensor();
  }
  if (!scaled) {
    t.copy_(slice);
    return at::Tensor();
  }
  auto staging = at::empty(t.sizes(), t.options());
  pending.emplace_back(t, staging);
  return staging;
}

}  // namespace leanddp::ops
