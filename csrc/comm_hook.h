// The seam between the Reducer and a user-registered communication hook (torch's
// `register_comm_hook` contract). The Reducer knows only this interface; bindings.cpp implements
// it for Python callables, so reducer.cpp never touches Python.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace leanddp {

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts reducing bucket `index`, whose flat buffer `buffer` holds this rank's gradients (not
  // divided by the world size: the hook averages, as torch's hooks do) of the parameters
  // `params` (Reducer indices, buffer order). Called on the autograd thread, in bucket order,
  // once per bucket per synchronized backward, with the Reducer's lock held: it must not call
  // back into the Reducer.
  virtual void launch(size_t index, const at::Tensor& buffer, bool is_last,
                      const std::vector<int64_t>& params) = 0;
  // Blocks until bucket `index`'s reduction is done and returns the reduced tensor (same numel
  // as the buffer; may be the buffer itself). Called from the end-of-backward callback.
  virtual at::Tensor wait(size_t index) = 0;
  // Whether bucket `index`'s reduction has finished (wait() would not block).
  virtual bool done(size_t index) = 0;
  // Drops in-flight results without waiting for them to be consumed (after an error).
  virtual void reset() = 0;
};

}  // namespace leanddp
