// The seam between the Reducer and an optimizer step it cannot run in C++ (optimizer_in_backward
// with an optimizer class, dtype or layout the fused kernels do not cover). bindings.cpp
// implements it for a Python callable, so reducer.cpp never touches Python.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace leanddp {

class BucketStepper {
 public:
  virtual ~BucketStepper() = default;
  // Steps parameters `params` (Reducer indices) of bucket `index` with their averaged gradients
  // `grads` (views into the bucket's flat buffer, shaped like the parameters). Called on the
  // autograd thread once the bucket's reduction is complete, with the Reducer's lock held: it
  // must not call back into the Reducer. The gradients are released after it returns.
  virtual void step(size_t index, const std::vector<int64_t>& params,
                    const std::vector<at::Tensor>& grads) = 0;
};

}  // namespace leanddp
