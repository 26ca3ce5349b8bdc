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
  // Starts reducing bucket `index` of `bucket_count`, whose flat buffer `buffer` holds this
  // rank's gradients (not divided by the world size: the hook averages, as torch's hooks do) of
  // the parameters `params` (Reducer indices, buffer order), each in the slice of `buffer` at
  // `offsets` of `lengths` elements (the Bucket's layout; both empty for a sparse gradient,
  // which is the buffer itself). Called on the autograd thread, in bucket order, once per bucket
  // per synchronized backward, with the Reducer's lock held: it must not call back into the
  // Reducer.
  virtual void launch(size_t index, size_t bucket_count, const at::Tensor& buffer,
                      const std::vector<int64_t>& params, const std::vector<int64_t>& offsets,
                      const std::vector<int64_t>& lengths) = 0;
  // Returns bucket `index`'s reduced tensor (same numel as the buffer; may be the buffer itself)
  // and forgets it. Called once per bucket per backward, from a hook or the end-of-backward
  // callback. On a GPU it is called with the stream that will read the result current (a side
  // stream with optimizer_in_backward): a CUDA future's wait makes that stream wait for the
  // reduction and blocks the host only until the future is complete (at once for NCCL).
  virtual at::Tensor wait(size_t index) = 0;
  // Blocks the host until bucket `index`'s future is complete, keeping its result for wait();
  // returns at once if the bucket has no pending future. Raises what the future raised.
  virtual void settle(size_t index) = 0;
  // Whether bucket `index`'s future is complete on the host (wait() would not block the host;
  // on a GPU its reduction may still be running, ordered by the future's events).
  virtual bool done(size_t index) = 0;
  // Drops in-flight results without waiting for them to be consumed (after an error).
  virtual void reset() = 0;
};

}  // namespace leanddp
