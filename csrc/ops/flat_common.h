// Host-side pieces of flatten_into / unflatten_from shared by the CPU and CUDA backends.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace leanddp::ops {

// A tensor's first byte. Only tensors the op writes go through data_ptr(): a read-only one
// (e.g. a lazily cloned, copy-on-write tensor) must not be materialized by reading it.
inline char* raw_data(const at::Tensor& t, bool written) {
  return written ? static_cast<char*>(t.data_ptr())
                 : const_cast<char*>(static_cast<const char*>(t.const_data_ptr()));
}

// True when `t` is exactly its slice [offset, offset + numel) of `flat`: non-overlapping and
// dense in any layout (contiguous, channels_last, a transposed matrix, ...), so its elements fill
// the slice, and its lowest element (data_ptr(), torch strides being non-negative) is element
// `offset`. Such a tensor is a bucket view: flattening it is a no-op, scaling it an in-place
// multiply of the slice's numel elements from data_ptr() on, whatever its strides.
bool is_flat_slice(const at::Tensor& t, const at::Tensor& flat, int64_t offset);

// Copies to run after the kernel: (destination, staging) pairs.
using PendingCopies = std::vector<std::pair<at::Tensor, at::Tensor>>;

// For a kernel that only handles contiguous memory: the contiguous tensor to process in place of
// the non-contiguous `t`, whose slice of `flat` starts at `offset`. Returns an undefined tensor
// when nothing is left to do. Flattening: `t` is copied into its slice now, and the slice is
// returned to be scaled in place. Unflattening: unscaled, `t` is filled now; scaled, a staging
// tensor is returned for the kernel to write, and (t, staging) is added to `pending`.
// Scaling always happens in our kernels, never in torch's in-place mul_, whose reduced-precision
// rounding of the scalar differs from `tensor * scale`.
at::Tensor contiguous_stand_in(const at::Tensor& t, const at::Tensor& flat, int64_t offset,
                               bool to_flat, bool scaled, PendingCopies& pending);

}  // namespace leanddp::ops
