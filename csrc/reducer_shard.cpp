// The Reducer's shard_optimizer_state paths (see reducer.h and shard.h): gathering the stepped
// weights back into the parameters (the gathers and the cut themselves: shard_gather.h). The
// sharded optimizer state is the optimizer's (in_backward_optimizer_state.cpp).
#include "reducer.h"

#include "op_calls.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

namespace leanddp {

void Reducer::gather_back(const std::function<void(size_t)>& stepped) {
  const auto finish = [this](size_t b) {
    shard_.finish(buckets_[b], b);
    release(b);
  };
  for (size_t b = 0; b < buckets_.size(); ++b) {
    stepped(b);
    ensure_allocated(b);
    shard_.start(process_group_, buckets_[b], b);
    if (b > 0) finish(b - 1);  // (in flight while bucket b's step was waited for)
  }
  if (!buckets_.empty()) finish(buckets_.size() - 1);
}

void Reducer::finish_gathers() {
  shard_.finish_deferred(buckets_, [this](size_t b) { release(b); });
}

}  // namespace leanddp
